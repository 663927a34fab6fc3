"""Helpers shared by the test files (fixtures are in conftest.py; HF checkpoints in hf_fixtures.py; subprocesses in
subproc.py; references that run TRL, transformers or peft in references.py)."""
import contextlib
import json
import math
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jodpo
from jodpo import train_step as ts
from jodpo.program.checkpoint import restore_params
from tests import hf_fixtures

ROOT = Path(__file__).resolve().parents[1]


def _load_export_script():
    """scripts/export_hf.py as a module (a script, not a package module)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_hf", ROOT / "scripts" / "export_hf.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


export_hf = _load_export_script()


def step_cfg(model, **kw):
    opt = ts.OptimizerConfig(**{"learning_rate": 1e-3, "total_steps": 10, **kw.pop("opt", {})})
    sampling = jodpo.SamplingConfig(max_new_tokens=6, temperature=1.0, eos_token_ids=model.eos_token_ids,
                                    pad_token_id=model.pad_token_id)
    return ts.StepConfig(model=model, sampling=sampling, optimizer=opt, **kw)


def prompt_batch(model, A, B, seed=0):
    rng = np.random.default_rng(seed)
    ids, mask = hf_fixtures.padded_batch(rng, list(rng.integers(2, 8, A * B)), model.pad_token_id, "left")
    return ids.reshape(A, B, -1), mask.reshape(A, B, -1)


def close_params(a, b, lr: float, updates: int):
    """Parameters after the same updates computed in another order: equal to float noise, except where a gradient
    entry is itself float noise (a key bias's is 0 in exact arithmetic, a rare token's head row nearly): there
    Adam's normalised step turns the noise into up to +-lr per update. So: no entry further apart than Adam can
    move it, and all but a thousandth of each array within 1e-4 relative (the key bias, noise throughout, aside)."""
    for (path, x), y in zip(jax.tree.leaves_with_path(a), jax.tree.leaves(b)):
        x, y, name = np.asarray(x), np.asarray(y), jax.tree_util.keystr(path)
        diff = np.abs(x - y)
        assert diff.max() <= 2 * lr * updates, name
        assert "k_bias" in name or (diff > 1e-6 + 1e-4 * np.abs(y)).mean() < 1e-3, name


def jaxpr_eqns(jaxpr, inside=False):
    """Every equation of ``jaxpr`` and of the jaxprs nested in it, depth first, each with whether it runs inside a
    while loop (``inside``: the whole of ``jaxpr`` does)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, inside
        for v in eqn.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    yield from jaxpr_eqns(sub, inside or eqn.primitive.name == "while")


def loop_converts(jaxpr, inside=False) -> list:
    """Shapes of the float32 -> other-dtype converts of 2-D or larger arrays inside while loops of ``jaxpr``."""
    return [eqn.invars[0].aval.shape for eqn, looped in jaxpr_eqns(jaxpr, inside)
            if looped and eqn.primitive.name == "convert_element_type" and eqn.invars[0].aval.dtype == jnp.float32
            and eqn.invars[0].aval.ndim >= 2 and eqn.params["new_dtype"] != jnp.float32]


def resumable_copy(src: Path, dst: Path) -> Path:
    """A copy of the run ``src`` without its last checkpoint (3), to resume from checkpoint 2."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "3")
    return dst


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def script(name: str):
    """``scripts/NAME.py`` as a module, loaded from its file (nothing added to sys.path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def benchmark(name: str):
    """A module of benchmarks/, imported as ``python benchmarks/bench.py`` imports it: by its plain name, with the
    benchmarks' folder first on sys.path while it and its siblings are imported."""
    import importlib
    import sys

    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(folder)


@contextlib.contextmanager
def gguf_parsed_once(file: Path):
    """``file``'s metadata parsed once while this lasts: transformers builds a new ``gguf.GGUFReader`` at each load of
    a GGUF file (the model's config and tensors, the tokenizer), and the reader parses the whole vocabulary in Python
    (262,144 tokens for Gemma 3: about 15 s each time on a CPU core). Every reader of ``file`` is then the one jodpo's
    loader opened (read-only: a memory map of the file); other files are read as before."""
    import gguf

    from jodpo.models.gguf import open_file

    reader, real = open_file(file).reader, gguf.GGUFReader

    def shared(path, *args, **kwargs):
        same = not args and not kwargs and Path(path).resolve() == Path(file).resolve()
        return reader if same else real(path, *args, **kwargs)

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = real


# What assert_same_run compares, and Nash-MD's own (TRL 1.12's names), compared where logged
SAME_RUN = ("loss", "logps/chosen", "logps/rejected", "objective/scores", "objective/kl", "rewards/margins",
            "grad_norm")
NASH_MD_METRICS = ("loss/score", "loss/kl", "rewards/probabilities", "rewards/chosen", "rewards/rejected")


def run_metrics(out: Path) -> dict[int, dict]:
    """A run's metrics.jsonl: its training steps' rows by step."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def assert_same_run(a: Path, b: Path, whole_arrays: bool = False) -> None:
    """The runs in ``a`` and ``b`` logged the same numbers and saved the same parameters, entry by entry (with
    ``whole_arrays``: each array within 1e-4 of the other's norm, for a run whose embedding rows are mostly tokens
    it never sees: their gradients are float noise, which Adam's normalised step turns into +-lr)."""
    ma, mb = run_metrics(a), run_metrics(b)
    assert sorted(ma) == sorted(mb) == [1, 2, 3]
    for step in ma:
        assert set(ma[step]) == set(mb[step]) and {"loss", "grad_norm", "logps/chosen"} <= set(ma[step])
        for k in (k for k in SAME_RUN + NASH_MD_METRICS + ("objective/off_policy_kl",) if k in ma[step]):  # async_mode's too
            assert mb[step][k] == pytest.approx(ma[step][k], rel=1e-4, abs=1e-5), (step, k)
    final = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()][-1]
    other = [json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()][-1]
    assert other["eval/objective/scores"] == pytest.approx(final["eval/objective/scores"], rel=1e-4, abs=1e-5)
    pa, pb = restore_params(a / "checkpoints" / "3"), restore_params(b / "checkpoints" / "3")
    for (path, x), y in zip(jax.tree.leaves_with_path(pa), jax.tree.leaves(pb)):
        if "k_bias" in jax.tree_util.keystr(path):
            # The key bias's gradient is exactly 0 in exact arithmetic (softmax ignores a per-query shift), so
            # Adam's normalised step turns float noise into +-lr: no layout can reproduce another's noise.
            continue
        if whole_arrays:
            assert np.linalg.norm(np.asarray(y) - np.asarray(x)) <= 1e-4 * np.linalg.norm(np.asarray(x)), path
        else:
            # Each Adam step moves an entry by at most lr (1e-3); where an entry's gradient is near cancellation, the
            # layouts' float noise changes its step by a few percent of that (1.2e-5 seen on a LoRA factor): 5% of lr.
            np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=5e-5, err_msg=str(path))


def assert_equals_transformers(model, params, hf, seed: int = 0, router: str | None = None, new_tokens: int = 8):
    """jodpo's ``(model, params)`` against the transformers model ``hf`` on left-padded prompts: the logits (1e-4 of
    the largest); where ``router`` says, each layer's router against transformers' ``output_router_logits`` (``"probs"``:
    they record its softmax, as Gemma 4's; ``"logits"``: its logits) and the experts it chose; greedy decoding of
    ``new_tokens`` against ``generate``."""
    import torch

    from jodpo.models import decoder

    ids, mask = hf_fixtures.padded_batch(np.random.default_rng(seed), [12, 5, 9, 1], model.pad_token_id, "left")
    ours = np.asarray(jax.jit(jodpo.logits, static_argnums=0)(model, params, ids, mask))
    with torch.no_grad():
        out = hf(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                 position_ids=torch.tensor(np.maximum(np.cumsum(mask, -1) - 1, 0), dtype=torch.long),
                 **({"output_router_logits": True} if router else {}))
    real = mask.astype(bool)
    ref = out.logits.numpy()
    np.testing.assert_allclose(ours[real], ref[real], rtol=1e-4, atol=1e-4 * np.abs(ref[real]).max())
    if router:
        _, _, routing = jax.jit(decoder.hidden_states, static_argnums=0, static_argnames="with_router")(
            model, params, ids, mask, with_router=True)
        got = np.asarray(jax.nn.softmax(routing.logits, -1) if router == "probs" else routing.logits)  # [N, B, L, E]
        theirs = np.stack([r.numpy().reshape(got.shape[1:]) for r in out.router_logits])
        atol = 1e-5 if router == "probs" else 1e-4 * np.abs(theirs).max()
        np.testing.assert_allclose(got[:, real], theirs[:, real], rtol=1e-4, atol=atol)
        chosen = lambda p: np.sort(np.argsort(-p, -1, kind="stable")[..., :model.moe.top_k], -1)  # noqa: E731
        np.testing.assert_array_equal(chosen(got[:, real]), chosen(theirs[:, real]))
    with torch.no_grad():
        want = hf.generate(input_ids=torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask),
                           do_sample=False, max_new_tokens=new_tokens, eos_token_id=[], pad_token_id=model.pad_token_id)
    cfg = jodpo.SamplingConfig(max_new_tokens=new_tokens, temperature=0.0, eos_token_ids=(),
                               pad_token_id=model.pad_token_id)
    got = jax.jit(jodpo.sample, static_argnums=(0, 5))(model, params, ids, mask, jax.random.key(0), cfg)
    np.testing.assert_array_equal(np.asarray(got.tokens), want[:, ids.shape[1]:].numpy())
