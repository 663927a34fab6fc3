"""The verifiable instruction task: IFEval's checkers (if-verifiable) give the verdicts IFEval's definitions give
(Zhou et al. 2023, Table 1, and the registry's code: words counted as \\w+ runs, keywords matched case-insensitively,
forbidden words at word boundaries, ...), the reward is the share followed, and the prompt sets are built as said."""
import json

import pytest

from jodpo.tasks import instructions as I

QUOTE = '"Peace abroad and thrift at home"'
# (instruction id, keyword arguments, completion, IFEval's verdict), each worked out by hand from the definition
CASES = [
    ("punctuation:no_comma", {}, "Peace and thrift matter", True),
    ("punctuation:no_comma", {}, "Peace, and thrift", False),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "one two three four", True),
    ("length_constraints:number_words", {"num_words": 5, "relation": "less than"}, "one two three four five", False),
    # "don't" is two \\w+ runs: 4 words by IFEval's count
    ("length_constraints:number_words", {"num_words": 4, "relation": "less than"}, "we don't", True),
    ("length_constraints:number_words", {"num_words": 4, "relation": "less than"}, "we don't go", False),
    ("keywords:existence", {"keywords": ["peace", "debt"]}, "PEACE without Debt.", True),
    ("keywords:existence", {"keywords": ["peace", "debt"]}, "Peace alone.", False),
    ("detectable_format:title", {}, "<<The Union>> It is strong.", True),
    ("detectable_format:title", {}, "<The Union> It is strong.", False),
    ("detectable_format:title", {}, "<<>> empty title", False),
    ("startend:quotation", {}, QUOTE, True),
    ("startend:quotation", {}, QUOTE[:-1], False),
    ("change_case:english_lowercase", {}, "the nation is at peace and the debt is paid.", True),
    ("change_case:english_lowercase", {}, "The nation is at peace and the debt is paid.", False),
    ("change_case:english_capital", {}, "THE NATION IS AT PEACE AND THE DEBT IS PAID.", True),
    ("change_case:english_capital", {}, "THE NATION IS AT PEACE and the debt is paid.", False),
    ("keywords:forbidden_words", {"forbidden_words": ["war"]}, "Peace, and a warm welcome.", True),  # not a word
    ("keywords:forbidden_words", {"forbidden_words": ["war"]}, "No more War.", False),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Done. any other questions? ", True),
    ("startend:end_checker", {"end_phrase": "Any other questions?"}, "Any other questions? Done.", False),
]


@pytest.mark.parametrize("instruction, kwargs, completion, expected", CASES)
def test_checkers_follow_ifevals_definitions(instruction, kwargs, completion, expected):
    assert I.followed(completion, [instruction], [kwargs]) == [expected]


def test_reward_is_the_share_followed_and_takes_the_dataset_columns():
    ids = [["punctuation:no_comma", "keywords:existence"]] * 4
    kwargs = [json.dumps([{}, {"keywords": ["peace"]}])] * 4
    prompts = [[{"role": "user", "content": "Summarize this passage."}]] * 4
    completions = ["Peace at last", "Peace, at last", "At last, war", [{"role": "assistant", "content": "peace"}]]
    assert I.instruction_reward(prompts, completions, ids, kwargs) == [1.0, 0.5, 0.0, 1.0]
    # IFEval's strict rule: an empty reply follows nothing, not even "no commas"
    assert I.instruction_reward(["p"], [""], [["punctuation:no_comma"]], ['[{}]']) == [0.0]


def test_unusable_instructions_are_refused_by_name():
    with pytest.raises(I.InstructionError, match="unknown instruction 'punctuation:no_commas'"):
        I.followed("x", ["punctuation:no_commas"], [{}])
    with pytest.raises(I.InstructionError, match="number_sentences.*punkt"):
        I.followed("x", ["length_constraints:number_sentences"], [{"num_sentences": 1}])
    with pytest.raises(I.InstructionError, match="2 ids but instruction_kwargs 1"):
        I.followed("x", ["punctuation:no_comma", "startend:quotation"], [{}])


def test_prompt_sets_keep_held_out_types_out_of_training():
    passage = "The revenue of the nation has grown while the debt of the nation has fallen and peace endures"
    items = [(f"a{i}", passage) for i in range(24)]
    train = I.build_rows(items, "train")
    assert train == I.build_rows(items, "train")  # deterministic
    seen = {i for r in train for i in r["instruction_id_list"]}
    assert seen <= set(I.TRAIN_TYPES) and len(seen) > 3 and {len(r["instruction_id_list"]) for r in train} == {1, 2}
    for r in train:
        if len(r["instruction_id_list"]) == 2:
            # IFEval's registry marks these two as conflicting
            assert set(r["instruction_id_list"]) != {"detectable_format:title", "startend:quotation"}
    for split, types in (("eval", I.TRAIN_TYPES), ("eval_held_out", I.HELD_OUT_TYPES)):
        rows = I.build_rows(items, split)
        assert [r["instruction_id_list"] for r in rows] == [[sorted(types)[n % len(types)]] for n in range(24)]
    row = I.build_rows(items[:2], "eval_held_out")[1]  # the types in sorted order: the second forbids a word
    assert row["instruction_id_list"] == ["keywords:forbidden_words"]
    [kw] = json.loads(row["instruction_kwargs"])
    text = row["prompt"][0]["content"]
    assert text.startswith(I.TASK + "\n\n" + passage) and text.endswith(I.describe(row["instruction_id_list"][0], kw))
    assert kw["forbidden_words"][0] in passage  # a word the summary would naturally use
