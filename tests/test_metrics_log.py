"""metrics.jsonl as a resumed run leaves it: each step's lines once, in order, none past the restored step."""
import json

from jodpo.program.metrics_log import truncate_metrics


def test_a_resume_keeps_each_step_once_in_order(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 1, "loss": 0.7}, {"step": 2, "loss": 0.6},
             {"step": 1, "loss": 0.75},  # a second run on the same directory, interleaved
             {"step": 2, "loss": 0.5}, {"step": 2, "eval/objective/scores": 0.1},  # a step's evaluation line stays
             {"step": 3, "loss": 0.4}, {"step": 4, "loss": 0.3}]  # past the checkpoint: logged again on resume
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 4, "lo')  # torn by a kill
    truncate_metrics(path, 3)
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "loss": 0.75}, {"step": 2, "loss": 0.5}, {"step": 2, "eval/objective/scores": 0.1},
        {"step": 3, "loss": 0.4}]
    truncate_metrics(path, 0)  # a run that starts over
    assert path.read_text() == ""
