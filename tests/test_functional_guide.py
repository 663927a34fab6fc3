"""docs/functional.md run as written: its ``python`` blocks, top to bottom in one process with 8 fake CPU devices (the
hand-written loop on one device and on a (data, fsdp, tensor) = (2, 2, 2) mesh, ``train_step``'s fused and split
paths, a reward of one's own, ``train_step`` on the mesh). Each jitted step compiles once per layout (the second step
on the mesh reuses the first one's program), XLA's partitioner reshards nothing by gathering it whole ("Involuntary
full rematerialization"), and ``jodpo.train_step`` and ``jodpo.parallel`` are reached from ``import jodpo`` alone."""
import json
import re
import subprocess
from pathlib import Path

from tests import subproc

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "functional.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)  # a block fenced ```python and nothing after it

# Before the guide: the attributes research code reaches from `import jodpo` alone (nothing else imported them
# yet), and a count of the programs each jitted function lowers (a lowering happens whether XLA then compiles or
# reads the persistent cache: it is a new argument layout either way)
PRELUDE = """\
import collections, json, jax, jodpo
assert jodpo.train_step.online_step and jodpo.parallel.sharding.make_mesh
lowered = collections.Counter()
jax.monitoring.register_event_duration_secs_listener(
    lambda event, _, fun_name='', **__: lowered.update([fun_name]) if event.endswith('jaxpr_to_mlir_module_duration') else None)
"""
AFTER = "print('LOWERED', json.dumps(lowered))\n"


def guide_code() -> str:
    blocks = BLOCK.findall(GUIDE.read_text())
    assert len(blocks) >= 8, "docs/functional.md lost its python blocks"
    return "\n".join(blocks)


def test_the_guide_runs_as_written_each_step_compiled_once_per_layout_nothing_resharded_whole(tmp_path):
    python, env = subproc.without_torch(subproc.cpu_env(8))
    done = subprocess.run([*python, "-c", PRELUDE + guide_code() + AFTER], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    lowered = json.loads(done.stdout.split("LOWERED ")[-1])
    # one device, then the mesh: two layouts, three steps on each
    for step in ("dpo_step", "online_step"):
        assert lowered[f"jit({step})"] == 2, lowered
    for step in ("sample_completions", "online_update"):  # the split path: one device only
        assert lowered[f"jit({step})"] == 1, lowered
    assert "Involuntary full rematerialization" not in done.stderr, done.stderr[-4000:]
    assert (tmp_path / "out" / "hf" / "config.json").is_file()
