"""``tools/requires_without.py``, the step of the engine environments (tools/engine_env.sh) that drops torch, its
media packages and CUDA-only kernels from an engine's requirements: extras and the named packages are left
out (names compared as pip does, ``_`` as ``-``, any case), every other requirement kept as written."""

from __future__ import annotations

import importlib.util
from importlib.metadata import requires
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("requires_without", ROOT / "tools" / "requires_without.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_named_packages_and_extras_are_left_out(tmp_path, capsys):
    out = tmp_path / "reqs.txt"
    assert _tool().main(["transformers", str(out), "Huggingface_Hub", "numpy"]) == 0
    kept = [ln for ln in out.read_text().splitlines() if ln]
    expected = [ln for ln in requires("transformers") if "extra ==" not in ln
                and not ln.lower().startswith(("huggingface-hub", "numpy"))]
    assert kept == expected and kept  # the others, as written, in order
    assert not any("extra ==" in ln for ln in kept)
    assert "left out: huggingface-hub, numpy" in capsys.readouterr().out


def test_randomise_parameters_follows_the_state_dict_rule():
    """``randomise_parameters`` (the engine tests' tiny models): norms 1 + small noise, the rest normal(0, std),
    the same values for the same seed, a different draw for another; bad arguments named."""
    import pytest
    import torch

    from mla_backends.testing import randomise_parameters

    def model():
        m = torch.nn.Module()
        m.proj, m.input_layernorm = torch.nn.Linear(64, 64, bias=False), torch.nn.LayerNorm(64)
        return m

    a = randomise_parameters(model(), seed=3, std=0.3)
    assert not a.training
    w, n = a.proj.weight, a.input_layernorm.weight
    assert 0.25 < float(w.std()) < 0.35 and abs(float(w.mean())) < 0.05
    assert 0.05 < float(n.std()) < 0.15 and abs(float(n.mean()) - 1.0) < 0.05
    b, c = randomise_parameters(model(), seed=3, std=0.3), randomise_parameters(model(), seed=4, std=0.3)
    assert torch.equal(a.proj.weight, b.proj.weight) and not torch.equal(a.proj.weight, c.proj.weight)
    with pytest.raises(TypeError, match="module: got dict"):
        randomise_parameters({})
    with pytest.raises(ValueError, match="std: got 0"):
        randomise_parameters(model(), std=0)


def test_hf_greedy_tokens_are_transformers_generate(tmp_path):
    """The engines' reference tokens: exactly ``max_new_tokens`` per prompt, the same as calling transformers'
    ``generate()`` by hand, one prompt at a time; bad prompts and counts named."""
    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    from mla_backends.testing import randomise_parameters
    from mla_backends.testing.engines import hf_greedy_tokens

    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=4, pad_token_id=0)
    model = randomise_parameters(transformers.LlamaForCausalLM(cfg), seed=1, std=0.3)
    model.save_pretrained(tmp_path)
    prompts = [[5, 7, 9], [11]]
    got = hf_greedy_tokens(tmp_path, prompts, 4)
    assert [len(g) for g in got] == [4, 4]
    for p, g in zip(prompts, got, strict=True):
        ids = torch.tensor([p])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, min_new_tokens=4,
                              do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert g == want
    with pytest.raises(TypeError, match="prompts: got"):
        hf_greedy_tokens(tmp_path, [[]], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        hf_greedy_tokens(tmp_path, prompts, 0)
