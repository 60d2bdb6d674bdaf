"""Text in: prompts from jsonl / parquet / datasets.Dataset (torchtpu_rl.data); text rewards in TRL's
convention (torchtpu_rl.rewards): built-ins, weights, None, resolution by name, and errors that name the
file, the column, the reward and the sample."""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from torchtpu_rl import rewards
from torchtpu_rl.data import PromptDataset, load_prompts
from torchtpu_rl.rewards import RewardFunctionError, RewardSet

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import rl_text_arith  # noqa: E402  (the example's task and tokenizer)

ROWS = [
    {"question": "Ann has 3 pens. She gets 4 more. How many pens does Ann have now?", "answer": "7", "level": 1},
    {"question": [{"role": "user", "content": "Tom has 9 cards. He loses 2. How many cards does Tom have now?"}],
     "answer": "#### 7", "level": 2},
    {"question": "Mia has 5 books. " * 12 + "How many?", "answer": "5", "level": 3},
    {"question": "Sam has 1 coin. He finds 1 more. How many coins does Sam have now?", "answer": None, "level": 1},
]


@pytest.fixture(scope="module")
def tok():
    train, _ = rl_text_arith.make_splits(300, 0)
    return rl_text_arith.build_tokenizer(train)


def _jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


def test_jsonl_parquet_and_datasets_give_the_same_prompts(tok, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain = [r for r in ROWS if isinstance(r["question"], str)]
    a = load_prompts(_jsonl(tmp_path / "p.jsonl", plain), tok, "question", shuffle=False)
    pq.write_table(pa.Table.from_pylist(plain), tmp_path / "p.parquet")
    b = load_prompts(str(tmp_path / "p.parquet"), tok, "question", shuffle=False)
    c = load_prompts(datasets.Dataset.from_list(plain), tok, "question", shuffle=False)
    assert a.items == b.items == c.items and a.texts == b.texts == c.texts
    assert a.texts[0] == plain[0]["question"]
    assert tok.decode(a.items[0][0]) == plain[0]["question"]
    # every other column is the prompt's metadata, as plain Python values
    assert a.items[0][1] == {"answer": "7", "level": 1} and b.items[2][1] == {"answer": None, "level": 1}
    with pytest.raises(TypeError, match="DatasetDict.*pass one split"):
        load_prompts(datasets.DatasetDict({"train": datasets.Dataset.from_list(plain)}), tok, "question")


def test_chat_prompts_use_the_tokenizer_chat_template(tok, tmp_path):
    ds = load_prompts(ROWS[:2], tok, "question", shuffle=False)
    assert ds.texts[0] == ROWS[0]["question"]  # plain text stays text
    assert ds.texts[1] == "<|user|>" + ROWS[1]["question"][0]["content"] + "<|assistant|>"
    assert tok.convert_ids_to_tokens(ds.items[1][0][0]) == "<|user|>"
    on = load_prompts(ROWS[:1], tok, "question", chat_template=True)  # text becomes a user turn
    assert on.texts[0] == "<|user|>" + ROWS[0]["question"] + "<|assistant|>"
    with pytest.raises(ValueError, match="row 1 column 'question' holds chat messages and chat_template=False"):
        load_prompts(ROWS[:2], tok, "question", chat_template=False)
    no_template = rl_text_arith.build_tokenizer(rl_text_arith.make_splits(50, 0)[0])
    no_template.chat_template = None
    with pytest.raises(ValueError, match="row 1 .* the tokenizer has no chat template"):
        load_prompts(ROWS[:2], no_template, "question")


def test_long_prompts_are_skipped_and_counted_or_an_error(tok):
    limit = 40
    assert len(tok(ROWS[2]["question"])["input_ids"]) > limit
    with pytest.warns(UserWarning, match="skipped 1 of 4 prompts longer than 40 tokens"):
        ds = load_prompts(ROWS, tok, "question", max_prompt_tokens=limit)
    assert len(ds) == 3 and ds.skipped == 1
    with pytest.raises(ValueError, match=r"row 2 prompt has \d+ tokens, more than max_prompt_tokens 40"):
        load_prompts(ROWS, tok, "question", max_prompt_tokens=limit, on_long_prompt="error")
    with pytest.raises(ValueError, match="every one of its 1 prompts is longer"):
        load_prompts(ROWS[2:3], tok, "question", max_prompt_tokens=limit)


def test_bad_data_names_the_file_row_and_column(tok, tmp_path):
    path = _jsonl(tmp_path / "q.jsonl", ROWS[:1])
    with pytest.raises(KeyError, match=r"q.jsonl.*no column 'prompt' \(the prompt column\); columns: "
                                       r"\['answer', 'level', 'question'\]"):
        load_prompts(path, tok, "prompt")
    two = _jsonl(tmp_path / "two.jsonl", [ROWS[0], {"answer": "1"}])
    with pytest.raises(KeyError, match="two.jsonl.*row 1 has no column 'question'"):
        load_prompts(two, tok, "question")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(ROWS[0]) + "\n{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl.*line 2 is not valid JSON"):
        load_prompts(str(bad), tok, "question")
    with pytest.raises(FileNotFoundError, match="missing.jsonl.*does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"), tok, "question")
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match="cannot read data file .*junk.parquet.* as parquet"):
        load_prompts(str(junk), tok, "question")
    with pytest.raises(ValueError, match="x.csv.*unsupported type"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_prompts(str(tmp_path / "x.csv"), tok, "question")
    empty = _jsonl(tmp_path / "e.jsonl", [{"question": ""}])
    with pytest.raises(ValueError, match="e.jsonl.*row 0 column 'question' is an empty prompt"):
        load_prompts(empty, tok, "question")
    nums = _jsonl(tmp_path / "n.jsonl", [{"question": 12}])
    with pytest.raises(TypeError, match="n.jsonl.*row 0 column 'question' is a int"):
        load_prompts(nums, tok, "question")


def test_text_dataset_keeps_the_seeded_resumable_cursor(tok):
    rows = [{"q": f"Ann has {i} pens.", "answer": str(i)} for i in range(7)]
    ds = load_prompts(rows, tok, "q", seed=5)
    first = ds.take(10)  # crosses an epoch
    assert sorted(i for i, _, _ in first[:7]) == list(range(7))
    state = ds.state_dict()
    nxt = ds.take(4)
    again = load_prompts(rows, tok, "q", seed=5)
    again.load_state_dict(state)
    assert again.take(4) == nxt
    assert [ds.text(i) for i, _, _ in nxt] == [rows[i]["q"] for i, _, _ in nxt]
    with pytest.raises(ValueError, match="seed 5, this dataset has seed 6"):
        load_prompts(rows, tok, "q", seed=6).load_state_dict(state)
    assert PromptDataset([([1, 2], None)]).text(0) is None  # the token-id API stays


# ------------------------------------------------------------------ rewards
def test_math_answer_reads_boxed_hashes_and_the_final_number():
    completions = ["so it is \\boxed{12}", "The answer is 7.", "#### 1,000", "I think 3 then 4", "no idea",
                   "\\boxed{\\frac{1}{2}}", "x = 0.5", "The answer is 7."]
    answers = ["12", "The total is 3 + 4 = 7.\n#### 7", "1000", "4", "5", "0.5", "\\boxed{1/2}", None]
    got = rewards.math_answer(prompts=[""] * 8, completions=completions, answer=answers)
    assert got == [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, None]
    assert rewards.extract_answer("a \\boxed{x^{2}} b") == "x^{2}"
    assert rewards.math_answer(prompts=[""], completions=["5"], solution=["\\boxed{5}"]) == [1.0]
    with pytest.raises(KeyError, match=r"needs a reference column.*the data has \['level'\]"):
        rewards.math_answer(prompts=[""], completions=["5"], level=[1], completion_ids=[[1]])


def test_format_and_length_penalty():
    fmt = rewards.regex_format(r"^The answer is \d+\.$", fullmatch=True)
    assert fmt(prompts=["", ""], completions=[" The answer is 7. ", "answer: 7"]) == [1.0, 0.0]
    assert fmt.__name__ == "format"
    pen = rewards.length_penalty(8, buffer=4)
    ids = [[0] * n for n in (3, 4, 6, 8, 12)]
    assert pen(prompts=[""] * 5, completions=[""] * 5, completion_ids=ids) == [0.0, 0.0, -0.5, -1.0, -1.0]
    with pytest.raises(ValueError, match="bad regular expression"):
        rewards.regex_format("(")


def test_resolve_reward_by_name_module_and_file(tmp_path, monkeypatch):
    assert rewards.resolve_reward("math_answer")[1] is rewards.math_answer
    name, fn = rewards.resolve_reward("format", format_regex="####")
    assert name == "format" and fn(prompts=[""], completions=["#### 4"]) == [1.0]
    name, fn = rewards.resolve_reward("length_penalty", max_new_tokens=16)
    assert fn(prompts=[""], completions=[""], completion_ids=[[0] * 16]) == [-1.0]
    assert rewards.resolve_reward("torchtpu_rl.rewards:math_answer") == ("math_answer", rewards.math_answer)
    f = tmp_path / "my_rewards.py"
    f.write_text("def short(prompts, completions, **kw):\n"
                 "    return [1.0 if len(c) < 5 else 0.0 for c in completions]\n"
                 "NOT_A_FUNCTION = 3\n")
    name, fn = rewards.resolve_reward(f"{f}:short")
    assert name == "short" and fn(prompts=["", ""], completions=["ok", "too long"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="unknown reward 'nope'.*built-in"):
        rewards.resolve_reward("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        rewards.resolve_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        rewards.resolve_reward(f"{f}:missing")
    with pytest.raises(ValueError, match="'NOT_A_FUNCTION' is a int, not a function"):
        rewards.resolve_reward(f"{f}:NOT_A_FUNCTION")


def test_reward_set_weights_none_and_columns():
    seen = {}

    def correct(prompts, completions, answer, **kw):
        seen.update(kw)
        return [None if a is None else float(c.strip() == a) for c, a in zip(completions, answer)]

    def brief(prompts, completions, **kw):
        return [1.0 if len(c) <= 3 else 0.0 for c in completions]

    rs = RewardSet([correct, ("brief", brief)], weights=[1.0, 0.5])
    meta = [{"answer": "7", "level": 1}, {"answer": "8", "level": 2}, {"answer": None, "level": 3},
            {"answer": "9"}]
    got = rs(["p"] * 4, ["7", "too long", "xx", "9"], meta)
    assert got == [1.5, 0.0, 0.5, 1.5]
    assert seen == {"level": [1, 2, 3, None]}  # every column, aligned with the samples
    assert rs.last_values == {"correct": [1.0, 0.0, None, 1.0], "brief": [1.0, 0.0, 1.0, 1.0]}
    assert rs.last_metrics["reward/correct"] == pytest.approx(2 / 3) and rs.last_metrics["reward/brief"] == 0.75
    none = RewardSet([lambda prompts, completions, **kw: [None] * len(completions)])
    assert none(["p"], ["c"], [{}]) == [0.0] and none.last_metrics["reward/none_applied"] == 1
    with pytest.raises(ValueError, match="2 weights for 1 rewards"):
        RewardSet([correct], [1.0, 2.0])


@pytest.mark.parametrize("bad,message", [
    (lambda prompts, completions, **kw: 1 / 0, "reward 'bad' raised ZeroDivisionError"),
    (lambda prompts, completions, **kw: [1.0], "reward 'bad' returned 1 values for 3 samples"),
    (lambda prompts, completions, **kw: [0.0, math.nan, 1.0], "reward 'bad' returned nan for sample 1 of 3"),
    (lambda prompts, completions, **kw: [0.0, 1.0, "high"], "reward 'bad' returned 'high' for sample 2 of 3"),
])
def test_a_bad_reward_is_named(bad, message):
    rs = RewardSet([rewards.math_answer, ("bad", bad)])
    with pytest.raises(RewardFunctionError, match=message):
        rs(["p"] * 3, ["1", "2", "3"], [{"answer": "1"}] * 3)


# ------------------------------------------------------------------ scoring a step (torchtpu_rl.scoring)
def _answer_reward(prompts, completions, answer, **_):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def test_a_reward_returning_the_wrong_length_stops_the_step():
    """A reward returning fewer values than samples is the function's contract broken: the step stops naming
    it (it used to be re-scored sample by sample, where one value per call looked right)."""
    from torchtpu_rl.scoring import RewardError, Scorer

    def short(prompts, completions, **_):
        return [0.5] * max(1, len(prompts) - 1)

    prompts, completions, metas = ["a", "b", "c"], ["1", "2", "3"], [{"answer": "1"}] * 3
    for reward in (RewardSet([short]), lambda ps, cs, ms: short(ps, cs)):
        scorer = Scorer(reward, on_error="continue")
        with pytest.raises(RewardError, match=r"returned 2 values for 3 samples in step 4; a reward must return "
                                              r"one value per sample"):
            scorer.score(prompts, completions, metas, step=4)


def test_on_error_continue_has_a_ceiling():
    """on_error='continue' scores a failing sample with the default, until more than max_error_fraction of a
    step's samples fail: a reward failing everywhere must not train on zeros."""
    from torchtpu_rl.scoring import RewardError, Scorer

    def picky(prompts, completions, **_):
        if any(c == "bad" for c in completions):
            raise ValueError("cannot parse 'bad'")
        return [1.0] * len(prompts)

    events = []
    scorer = Scorer(RewardSet([picky]), on_error="continue", default=-1.0, max_error_fraction=0.5, events=events)
    with pytest.warns(RuntimeWarning, match=r"reward for sample 1 RewardFunctionError: reward 'picky' raised "
                                            r"ValueError: cannot parse 'bad'.*1 bad sample\(s\) in step 0"):
        vals, n_bad, _ = scorer.score(["p"] * 4, ["ok", "bad", "ok", "ok"], [{}] * 4, step=0)
    assert vals == [1.0, -1.0, 1.0, 1.0] and n_bad == 1 and events[0]["count"] == 1
    with pytest.raises(RewardError, match=r"3 of 4 samples failed, more than max_error_fraction 0.5 allows"):
        scorer.score(["p"] * 4, ["bad", "bad", "ok", "bad"], [{}] * 4, step=1)
    stop = Scorer(RewardSet([picky]), on_error="stop")
    with pytest.raises(RewardError, match=r"reward for sample 1 .*cannot parse 'bad'"):
        stop.score(["p"] * 2, ["ok", "bad"], [{}] * 2, step=0)
    with pytest.raises(ValueError, match=r"max_error_fraction must be in \[0, 1\], not 2"):
        Scorer(picky, max_error_fraction=2)
    # a reward that works: one call, the RewardSet's per-reward means come back
    rs = RewardSet([_answer_reward])
    vals, n_bad, parts = Scorer(rs, metrics_of=rs).score(["p", "q"], ["1", "2"], [{"answer": "1"}, {"answer": "3"}],
                                                         step=0)
    assert vals == [1.0, 0.0] and n_bad == 0 and parts["reward/_answer_reward"] == 0.5
