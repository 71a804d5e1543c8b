"""The llama3 case's replacements of megatron-core's private names go through one module,
cases/llama3/megatron/mcore_patches.py, with a version guard.

Here: every patch names its switch, module, names and verified versions, and docs/cases/llama3.md
lists each; an unverified version is refused naming the switch, the versions and the way back;
no other module of the case assigns to a megatron-core module. In the megatron-core environment
(0.16.1): each patch's names exist, applying and restoring puts megatron's own objects back, the
case's install functions go through the patches, and run_meta's record lists the ones in use.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess

import pytest

from cases.llama3.megatron import mcore_patches
from tests.case_helpers import framework_python
from tests.test_llama3_megatron_case import CASE_DIR, ROOT


def test_each_patch_is_described_and_verified_somewhere():
    assert set(mcore_patches.PATCHES) == {"rope_compile", "rope_qkv", "wgrad_accumulation", "grad_clip", "offload_copy", "symm_mem_linears"}
    for key, patch in mcore_patches.PATCHES.items():
        assert patch.switch.startswith("parallel."), key
        assert patch.module.startswith("megatron.core."), key
        assert patch.names and set(patch.may_add) <= set(patch.names), key
        assert mcore_patches.CPU in patch.verified, f"{key}: not verified on the CPU environment's megatron-core"


def test_the_cpu_environment_pins_the_verified_version():
    pins = (ROOT / "vendors" / "cpu" / "megatron" / "requirements.txt").read_text()
    assert f"megatron-core=={mcore_patches.CPU}" in pins


@pytest.mark.parametrize("key", sorted(mcore_patches.PATCHES))
def test_an_unverified_version_is_refused_naming_the_way_back(key):
    patch = mcore_patches.PATCHES[key]
    with pytest.raises(mcore_patches.UnverifiedMegatron) as err:
        mcore_patches.require(key, installed="0.17.0")
    msg = str(err.value)
    assert patch.switch in msg and "this is 0.17.0" in msg and "turn the switch off" in msg
    assert all(v in msg for v in patch.verified) and all(n in msg for n in patch.names)


def test_docs_list_every_patch():
    doc = (ROOT / "docs" / "cases" / "llama3.md").read_text()
    for key, patch in mcore_patches.PATCHES.items():
        assert f"`{key}`" in doc, f"docs/cases/llama3.md does not list patch {key}"
        for name in patch.names:
            assert name in doc, f"docs/cases/llama3.md does not name {patch.module}.{name} ({key})"


def _megatron_aliases(tree: ast.Module) -> set[str]:
    """Names bound to a megatron module or class by the module's imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron"):
            names |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("megatron")}
    return names


def assignments_to_megatron(source: str) -> list[str]:
    """``line name.attr`` of each assignment (``=``, ``+=``, ``setattr``, ``delattr``) to an
    attribute of a megatron-core module or class that ``source`` imports."""
    tree = ast.parse(source)
    aliases = _megatron_aliases(tree)
    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") and node.args:
            targets = [ast.Attribute(value=node.args[0], attr="?")]
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id in aliases:
                    found.append(f"{node.lineno} {el.value.id}.{el.attr}")
    return found


def test_the_source_check_sees_each_kind_of_assignment():
    source = (
        "from megatron.core.transformer import attention\n"
        "import megatron.core.optimizer.clip_grads as clip_grads\n"
        "attention.HAVE_FUSED_QKV_ROPE = True\n"
        "clip_grads.l2_norm_impl, x = f, 1\n"
        "setattr(attention, 'apply_fused_qkv_rotary_pos_emb', g)\n"
        "other.name = 1\n"
    )
    assert assignments_to_megatron(source) == ["3 attention.HAVE_FUSED_QKV_ROPE", "4 clip_grads.l2_norm_impl", "5 attention.?"]


def test_no_other_module_of_the_case_assigns_to_megatron():
    found = [
        f"{p.name}:{hit}"
        for p in sorted(CASE_DIR.glob("*.py"))
        if p.name != "mcore_patches.py"
        for hit in assignments_to_megatron(p.read_text())
    ]
    assert not found, f"megatron-core names replaced outside mcore_patches.py: {found}"


IN_ENV = r"""
import json, sys
import torch
from types import SimpleNamespace
from cases.llama3.megatron import kernels, mcore_patches as mp
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.tensor_parallel import layers
from megatron.core.transformer import attention

out = {"version": mp.version()}
for key in mp.PATCHES:
    mp.require(key)  # the names are there, the version is verified
own = (rope_utils._apply_rotary_pos_emb_bshd, attention.HAVE_FUSED_QKV_ROPE, hasattr(attention, "apply_fused_qkv_rotary_pos_emb"),
       clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, layers._grad_accum_fusion_available,
       hasattr(layers, "fused_weight_gradient_mlp_cuda"))
kernels.install_rope("compile", SimpleNamespace())
out["compile"] = rope_utils._apply_rotary_pos_emb_bshd is kernels.compiled_rope
kernels.install_rope("qkv", SimpleNamespace(fused_single_qkv_rope=True))
out["qkv"] = [rope_utils._apply_rotary_pos_emb_bshd is own[0], attention.HAVE_FUSED_QKV_ROPE, attention.apply_fused_qkv_rotary_pos_emb is kernels.qkv_rope]
out["clip"] = kernels.install_grad_clip(True)
out["wgrad"] = kernels.install_wgrad_accumulation(torch.device("cpu"), torch.float32)
out["meta"] = mp.applied()
kernels.install_rope("none", SimpleNamespace())
kernels.install_grad_clip(False)
mp.restore("wgrad_accumulation")
after = (rope_utils._apply_rotary_pos_emb_bshd, attention.HAVE_FUSED_QKV_ROPE, hasattr(attention, "apply_fused_qkv_rotary_pos_emb"),
         clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl, layers._grad_accum_fusion_available,
         hasattr(layers, "fused_weight_gradient_mlp_cuda"))
out["restored"] = all(a is b or a == b for a, b in zip(own, after))
out["meta_after"] = mp.applied()
print("RESULT " + json.dumps(out))
"""


@pytest.mark.framework("megatron")
def test_patches_apply_and_restore_on_the_cpu_megatron_core():
    py = framework_python("FB_TEST_MEGATRON_PYTHON", "no megatron-core environment to run the case in")
    proc = subprocess.run(
        [py, "-c", IN_ENV], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    out = json.loads(line[len("RESULT ") :])
    assert out["version"] == mcore_patches.CPU
    assert out["compile"] is True
    assert out["qkv"] == [True, True, True]  # compile's routed back when qkv is asked for
    assert out["clip"].startswith("torch foreach") and out["wgrad"] == "torch addmm into main_grad"
    assert out["meta"] == {
        "megatron_core": mcore_patches.CPU,
        "applied": {k: mcore_patches.PATCHES[k].switch for k in ("grad_clip", "rope_qkv", "wgrad_accumulation")},
    }
    assert out["restored"] is True
    assert out["meta_after"] == {"megatron_core": mcore_patches.CPU, "applied": {}}
