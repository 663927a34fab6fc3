"""The SOTU summarisation task's prompts and reward (jodpo/summaries.py), against hand computations."""
import json

import pytest

from jodpo.tasks import summaries as Su

PASSAGE = ("The Congress must fund the navy and the army. The navy protects our commerce, and the army our "
           "frontier; the navy and the army need ships, forts and men.")


def test_summary_reward_by_hand():
    keys = Su.key_words(PASSAGE)
    # key words: navy, army (3 times each), then the first six seen once: congress, fund, protects, commerce, ...
    assert keys == {"navy", "army", "congress", "fund", "protects", "commerce", "frontier", "need"}
    # covers 4 of the 8 (congress, fund, navy, army), every content word is in the passage, one sentence
    s = "Congress must fund the navy and army."
    assert Su.score_summary(PASSAGE, s) == pytest.approx(4 / 8 + 1.0 - 1.0)
    # the same words, then an invented second sentence: grounding 4/6, a second sentence costs 0.5
    s2 = s + " Bananas grow."
    assert Su.score_summary(PASSAGE, s2) == pytest.approx(4 / 8 + 4 / 6 - 1.0 - 0.5)
    assert Su.score_summary(PASSAGE, "Navy.") == pytest.approx(1 / 8 + 1.0 - 1.0 - 0.5)  # under 6 words: -0.5
    assert Su.score_summary(PASSAGE, "Bananas. " * 40) == -1.0  # clipped
    prompt = [{"role": "user", "content": Su.INSTRUCTION + PASSAGE}]
    # chat data: TRL hands reward functions the completions as assistant messages
    assert Su.summary_reward([prompt, Su.INSTRUCTION + PASSAGE], [[{"role": "assistant", "content": s}], s]) == \
        [pytest.approx(4 / 8)] * 2


def test_prompts_split_by_year_and_drop_stage_directions(tmp_path):
    data = tmp_path / "data"
    (data / "speeches").mkdir(parents=True)
    (data / "metadata.csv").write_text("fileid,year\n1801-Jefferson-1,1801\n1807-Jefferson-7,1807\n")
    words = " ".join(["liberty"] * 30)
    (data / "speeches" / "1801-Jefferson-1.txt").write_text(f"The President. {words} [Applause]\n\nToo short.\n")
    (data / "speeches" / "1807-Jefferson-7.txt").write_text(words + "\n")
    train, test = Su.write_prompts(data, tmp_path / "prompts")
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert rows == [{"prompt": [{"role": "user", "content": Su.INSTRUCTION + words}], "address": "1801-Jefferson-1"}]
    assert [json.loads(line)["address"] for line in test.read_text().splitlines()] == ["1807-Jefferson-7"]
