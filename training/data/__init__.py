"""Data utilities shared by the cases: Megatron's indexed dataset format and a
deterministic synthetic corpus written in it.  numpy only."""
