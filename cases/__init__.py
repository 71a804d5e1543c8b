"""The cases: one package per model family x framework, imported as cases.<family>.<framework>.<module>."""
