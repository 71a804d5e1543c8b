"""The model shape schema (training/shapes.py): what a case.yaml states, what planning resolves,
and the messages a wrong shape gets, each naming the file, the model and the key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from run_benchmarks.errors import InputError
from run_benchmarks.planning.config import CaseConfig, load, problems
from run_benchmarks.planning.registry import ROOT
from training import shapes
from training.settings import SettingsError

GPT3 = ROOT / "cases/gpt3/paddle/case.yaml"
LLAVA = ROOT / "cases/llava/deepspeed/case.yaml"


def written(tmp_path: Path, source: Path, edit) -> Path:
    data = yaml.safe_load(source.read_text())
    edit(data)
    path = tmp_path / "case.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def model_shape(data: dict, model: str = "gpt3_6.7B") -> dict:
    return data["models"][model]["shape"]


@pytest.mark.parametrize(
    "edit, field, says",
    [
        (lambda d: model_shape(d).update(num_kv_heads=8), "models.gpt3_6.7B.shape", "num_kv_heads is not a field of ModelShape"),
        (lambda d: model_shape(d).update(hidden_size="big"), "models.gpt3_6.7B.shape.hidden_size", "must be an integer, got 'big'"),
        (lambda d: model_shape(d).update(num_heads=7), "models.gpt3_6.7B.shape", "hidden_size 4096 is not a multiple of num_heads 7"),
        (lambda d: model_shape(d).update(bias=["q", "gate"]), "models.gpt3_6.7B.shape", "bias: true, false or a list of q, k, v, o, mlp"),
        (lambda d: d["shape_defaults"].update(norm="batchnorm"), "shape_defaults.norm", "must be one of rmsnorm, layernorm"),
        (lambda d: d["shape_defaults"].update(rotary=True), "shape_defaults", "rotary is not a field of ModelShape"),
        (lambda d: d.update(shape_schema="Qwen2Shape"), "shape_schema", "'Qwen2Shape' is not one of ModelShape, LlavaShape"),
    ],
)
def test_a_wrong_shape_names_the_file_the_model_and_the_key(tmp_path, edit, field, says):
    path = written(tmp_path, GPT3, edit)
    with pytest.raises(InputError) as err:
        load(CaseConfig, path)
    assert str(err.value).startswith(f"{path}: field '{field}': ") and says in str(err.value), err.value
    (line,) = problems(CaseConfig, path)  # what `flagbench check` prints of it
    assert line == str(err.value)


def test_a_model_without_a_shape_is_named_by_the_field_check(tmp_path):
    path = written(tmp_path, GPT3, lambda d: d["models"]["gpt3_13B"].pop("shape"))
    assert problems(CaseConfig, path) == [
        f"{path}: field 'models.gpt3_13B.shape': Field required; add 'shape: <value>' under 'models.gpt3_13B'"
    ]


def test_a_block_states_its_sizes_and_the_family_its_flags():
    raw = yaml.safe_load(GPT3.read_text())
    case = load(CaseConfig, GPT3)
    for name, entry in raw["models"].items():
        assert not set(entry["shape"]) & set(shapes.GPT), f"{name} repeats a family flag"
        shape = shapes.read(case.models[name].shape)
        assert shape.differs(shapes.GPT, "GPT-3") == [] and shape.learned_positions and shape.kv_groups == shape.num_heads
        assert shape.max_position_embeddings == shape.seq_length  # absent: the sequence length
    # a block's own key wins over the family's
    over = shapes.from_block(
        shapes.ModelShape, raw["shape_defaults"], {**raw["models"]["gpt3_6.7B"]["shape"], "bias": ["q", "k", "v"]}, ("m",)
    )
    assert over.bias == ("q", "k", "v") and over.biased("k") and not over.biased("o")


def test_llava_reads_its_vision_tower_through_its_schema(tmp_path):
    case = load(CaseConfig, LLAVA)
    shape = shapes.read(case.models["llava1.5_7b"].shape, shapes.LlavaShape)
    assert (shape.image_size, shape.patch_size, shape.vision_num_layers, shape.num_kv_groups) == (336, 14, 24, 32)
    assert set(shape.palm_assumptions) == {"pretrain", "finetune"}
    # the same file read as a plain decoder: the vision keys are no fields of ModelShape
    path = written(tmp_path, LLAVA, lambda d: d.pop("shape_schema"))
    (line,) = problems(CaseConfig, path)
    assert line == f"{path}: field 'shape_defaults': patch_size is not a field of ModelShape (training/shapes.py)"


def test_the_ranks_refuse_a_shape_their_model_code_does_not_build():
    case = load(CaseConfig, GPT3)
    flat = dict(case.models["gpt3_6.7B"].shape)
    assert shapes.built(flat, shapes.GPT, "GPT-3", multi_head=True).num_layers == flat["num_layers"]
    with pytest.raises(SettingsError) as err:
        shapes.built({**flat, "norm": "rmsnorm", "num_kv_groups": 8}, shapes.GPT, "GPT-3", multi_head=True)
    assert str(err.value) == (
        "resolved config: model.shape: norm is 'rmsnorm', GPT-3 has 'layernorm'; "
        f"num_kv_groups is 8: GPT-3 has multi-head attention ({flat['num_heads']} groups)"
    )
