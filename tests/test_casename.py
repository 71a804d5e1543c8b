import pytest

from run_benchmarks.errors import InputError
from run_benchmarks.planning.casename import CaseName


def test_parse_full_and_default_repeat():
    cn = CaseName.parse("llama3_8b:megatron:A100:1:8")
    assert (cn.model, cn.framework, cn.hardware, cn.nnodes, cn.nprocs, cn.repeat) == ("llama3_8b", "megatron", "A100", 1, 8, 1)
    assert cn.size == "A100x1x8" and cn.world_size == 8
    assert CaseName.parse("gpt3_6.7B:paddle:A100:2:8:3").repeat == 3
    assert CaseName.parse("baichuan2_13b:deepspeed:BI-V150:2:4").size == "BI-V150x2x4"
    assert str(CaseName.parse("llava1.5_7b:deepspeed:A800:1:8")) == "llava1.5_7b:deepspeed:A800:1:8:1"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("llama3_8b:megatron:A100:1", "must have the form"),
        ("llama3_8b:megatron:A100:1:8:1:9", "must have the form"),
        ("llama3_8b:megatron:A100:0:8", "nnodes must be a positive integer"),
        ("llama3_8b:megatron:A100:1:0", "nprocs must be a positive integer"),
        ("llama3_8b:megatron:A100:1:-2", "nprocs must be a positive integer"),
        ("llama3_8b:megatron:A100:1:8:0", "repeat must be a positive integer"),
        ("llama3_8b:megatron:A100:one:8", "nnodes must be a positive integer"),
        ("llama3_8b;rm -rf /:megatron:A100:1:8", "model"),
        ("llama3_8b:mega$(id):A100:1:8", "framework"),
        ("llama3_8b:megatron:../etc:1:8", "hardware"),
        ("llama3_8b:megatron:A1/00:1:8", "hardware"),
        ("../x:megatron:A100:1:8", "model"),
        ("a..b:megatron:A100:1:8", "model"),
        (":megatron:A100:1:8", "model"),
        ("llama3 8b:megatron:A100:1:8", "model"),
        ("llama3_8b:megatron:A100:1:8 ", "nprocs"),
    ],
)
def test_rejects(text, fragment):
    with pytest.raises(InputError) as exc:
        CaseName.parse(text)
    assert fragment in str(exc.value)
