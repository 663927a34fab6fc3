"""metrics.jsonl as a resumed run leaves it: each step's lines once, in order, none past the restored step; the
console: a time left from the steady steps, which numbers carry the EOS penalty, and, off a terminal, the bar as
lines of its own."""
import io
import json

from jodpo.program.metrics_log import RunLogger, StepBar, penalty_note, truncate_metrics


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


def test_the_time_left_counts_the_steady_steps_not_the_compile():
    clock = [0.0]
    bar = StepBar(total=101, file=io.StringIO(), bar_format="{remaining}", mininterval=0)
    bar._time = lambda: clock[0]
    left = lambda: StepBar.format_meter(**bar.format_dict)  # noqa: E731
    assert left() == "?"
    clock[0] = 40.0  # the first step compiles for 40 s
    bar.update()
    assert left() == "?"  # one step tells nothing of the steady rate (tqdm's own: 100 x 40 s)
    for _ in range(4):  # then 0.5 s a step
        clock[0] += 0.5
        bar.update()
    assert left() == "00:48"  # 96 steps x 0.5 s
    resumed = StepBar(total=101, initial=50, file=io.StringIO(), bar_format="{remaining}", mininterval=0)
    resumed._time = lambda: clock[0]
    clock[0] += 30.0  # a resumed run's first step compiles too (or reads the cache)
    resumed.update()
    clock[0] += 2.0
    resumed.update(2)
    assert StepBar.format_meter(**resumed.format_dict) == "00:48"  # 48 steps x 1 s


def test_the_screen_says_which_numbers_carry_the_eos_penalty(tmp_path, capsys):
    note = penalty_note(1.0, None)
    assert "minus missing_eos_penalty=1.0" in note and "eval/objective/scores show the reward before" in note
    assert "replaced by penalty_reward_value=-1.0" in penalty_note(None, -1.0) and penalty_note(None, None) is None
    rows = [("review this :", "good good", 0.9)]
    for penalty, header in ((note, "reward before EOS penalty"), (None, "score")):
        logger = RunLogger(tmp_path, 10, 0, report_to="none", penalty=penalty)
        logger.log({"step": 1, "loss": 0.69, "objective/scores": -0.1, "eps": 3.0})
        logger.table(1, rows)
        logger.close()
        said = capsys.readouterr()
        err = said.out + said.err  # tqdm writes lines to stdout, the bar to stderr
        assert err.count(note) == (1 if penalty else 0), err
        assert f"| {'completion':50s} | {header}\n" in err and "| 0.900" in err
        assert "score -0.100" in err  # the bar: objective/scores, as metrics.jsonl names it


def test_off_a_terminal_the_bar_is_a_line_per_logged_step_and_messages_lines_of_their_own(tmp_path, capsys):
    """stderr not a terminal (a log file; here pytest's capture): no carriage returns, no blanking, each logged step
    one line once it ends, and nothing printed meanwhile lands on the bar's line (with ``2>&1`` they share a file)."""
    logger = RunLogger(tmp_path, 4, 0, report_to="none")
    logger.message("step 1 compiles the step's programs first")
    for step in range(1, 5):
        if step % 2 == 0:  # logging_steps=2
            logger.log({"step": step, "loss": 0.69, "objective/scores": 0.25 * step, "eps": 3.0})
            logger.table(step, [("review this :", "good good", 0.9)])
        logger.advance()
    logger.close()
    stopped = RunLogger(tmp_path, 4, 0, report_to="none")  # a run that stops between logged steps says where
    stopped.advance()
    stopped.close()
    said = capsys.readouterr()
    assert "\r" not in said.err and all(line.strip() for line in said.err.splitlines()), repr(said.err)
    bars = said.err.splitlines()
    # the start, steps 2 and 4 (the end); the stopped run's start and its end
    assert [line.split(" [")[0] for line in bars] == ["online dpo 0/4", "online dpo 2/4", "online dpo 4/4",
                                                       "online dpo 0/4", "online dpo 1/4"], bars
    assert "score 0.500" in bars[1] and "score 1.000" in bars[2]
    assert said.out.splitlines()[0] == "step 1 compiles the step's programs first"
    assert said.out.count("step 2: completions\n") == 1 and said.out.count("step 4: completions\n") == 1
