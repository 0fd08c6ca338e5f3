"""data.py: reading CSVs (columns, encodings, empty rows, ids), prompts and targets cut to block_size, the
token cache, and the training/eval batches each rank sees."""
import contextlib
import itertools
import os
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
import torch

import data
from command_line import UserError
from config import PROMPT_TEMPLATE, Config
from conftest import HANG, REPO, save_csv
from data import EOT_ID, LengthGroupedSampler, TrainBatches, get_tokenizer

enc = get_tokenizer()


def dialogue(i, turns=3):
    return "\n".join(f"Person{i % 5}: message {i}-{t} about the plan for {'tomorrow' * (t % 3)}."
                     for t in range(turns))


def write_rows(path, n, start=0, turns=3):
    rows = [{"id": str(start + i), "dialogue": dialogue(start + i, turns + i % 7),
             "summary": f"Person{i % 5} talks about plan {start + i}."} for i in range(n)]
    save_csv(path, rows)
    return rows


def make_cfg(tmp_path, **overrides):
    values = dict(train_csv=str(tmp_path / "train.csv"), test_csv=str(tmp_path / "test.csv"),
                  data_cache_dir=str(tmp_path / "cache"), block_size=256, max_new_tokens=32, init_from="scratch",
                  batch_size=16, micro_batch_size=4)
    values.update(overrides)
    return Config(**values)


def user_error(call):
    with pytest.raises(UserError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


# ---- reading CSVs ------------------------------------------------------------------------------------------

def test_columns_are_auto_detected_or_taken_from_config(tmp_path):
    path = tmp_path / "cnn.csv"
    pd.DataFrame({"ID": ["a", "b"], " Article": ["x y", "z"], "highlights": ["s1", "s2"]}).to_csv(path, index=False)
    table = data.read_table(str(path), "train_csv", make_cfg(tmp_path))
    assert (table.ids, table.dialogues, table.summaries) == (["a", "b"], ["x y", "z"], ["s1", "s2"])
    pd.DataFrame({"conv": ["x"], "gist": ["s"], "dialogue": ["other"]}).to_csv(path, index=False)
    table = data.read_table(str(path), "train_csv", make_cfg(tmp_path, dialogue_column="conv", summary_column="gist"))
    assert (table.ids, table.dialogues, table.summaries) == (["0"], ["x"], ["s"])


def test_missing_column_lists_the_columns_found(tmp_path):
    path = tmp_path / "train.csv"
    pd.DataFrame({"id": [1], "dialogue": ["x"], "gist": ["s"]}).to_csv(path, index=False)
    message = user_error(lambda: data.read_table(str(path), "train_csv", make_cfg(tmp_path)))
    assert str(path) in message and "'id', 'dialogue', 'gist'" in message and "--summary_column=" in message
    message = user_error(lambda: data.read_table(str(path), "train_csv", make_cfg(tmp_path, summary_column="sum")))
    assert "'sum'" in message


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"),
    (b"", "is empty"),
    (b"\n\n", "is empty"),
    (b"\xef\xbb\xbf\r\n", "is empty"),
    (b"id,dialogue,summary\r\n", "no data rows"),
    (b'id;;dialogue;;summary\n1;;"A: hi, you";;greeting\n2;;B: yo;;hey\n', "not comma-separated"),
    (b"id;;dialogue;;summary\n1;;A: hi;;greeting\n", "not comma-separated"),
    (b"id\tdialogue\tsummary\n1\tA: hi\tgreeting\n", "not comma-separated"),
    (b'id,dialogue,summary\n1,"A: hi,greet\n2,B: x, y, z\n', "not a readable CSV"),
])
def test_unreadable_files_are_one_clear_error(tmp_path, content, expected):
    path = tmp_path / "train.csv"
    if content is not None:
        path.write_bytes(content)
    message = user_error(lambda: data.read_table(str(path), "train_csv", make_cfg(tmp_path)))
    assert expected in message and str(path) in message and "train_csv" in message


def test_bom_crlf_quoted_newlines_emoji_and_non_utf8_bytes(tmp_path):
    path = tmp_path / "train.csv"
    path.write_bytes(b'\xef\xbb\xbfid,dialogue,summary\r\n'
                     b'1,"Amanda: caf\xe9?\r\nJerry: sure \xf0\x9f\x98\x80\r\n",Coffee \xe2\x98\x95\r\n'
                     b'2,"A: ""quoted""\rB: ok",Quotes.\r\n')
    table = data.read_table(str(path), "train_csv", make_cfg(tmp_path))
    assert table.ids == ["1", "2"]
    assert table.dialogues == ["Amanda: café?\nJerry: sure 😀", 'A: "quoted"\nB: ok']
    assert table.summaries == ["Coffee ☕", "Quotes."]


def test_empty_dialogue_or_summary_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "train.csv"
    pd.DataFrame({"id": list("abcdef"), "dialogue": ["x", "", "y", None, "  \r\n ", "z"],
                  "summary": ["s", "s", None, "s", "s", "t"]}).to_csv(path, index=False)
    table = data.read_table(str(path), "train_csv", make_cfg(tmp_path))
    assert (table.ids, table.empty) == (["a", "f"], 4)
    path.write_text("id,dialogue,summary\n1,,\n2, , \n")
    assert "every row has an empty" in user_error(lambda: data.read_table(str(path), "train_csv", make_cfg(tmp_path)))


def test_test_csv_keeps_every_row_and_rejects_duplicate_ids(tmp_path):
    path = tmp_path / "test.csv"
    pd.DataFrame({"id": ["7", "8", "9"], "dialogue": ["x", "", "z"]}).to_csv(path, index=False)
    table = data.read_test(make_cfg(tmp_path))
    assert (table.ids, table.dialogues, table.summaries, table.empty) == (["7", "8", "9"], ["x", "", "z"], None, 1)
    pd.DataFrame({"id": ["7", "8", "7", "8", "1"], "dialogue": list("abcde")}).to_csv(path, index=False)
    message = user_error(lambda: data.read_test(make_cfg(tmp_path)))
    assert "2 duplicated id(s), e.g. 7, 8" in message and "test_csv" in message
    pd.DataFrame({"key": ["7"], "dialogue": ["a"]}).to_csv(path, index=False)
    assert "no id column" in user_error(lambda: data.read_test(make_cfg(tmp_path)))


# ---- splits, examples, masks ------------------------------------------------------------------------------

def test_validation_split_is_deterministic_or_taken_from_validation_csv(tmp_path):
    write_rows(tmp_path / "train.csv", 100)
    cfg = make_cfg(tmp_path)
    first, second = data.load_splits(cfg), data.load_splits(cfg)
    assert first.val.ids == second.val.ids and len(first.val) == 5 and len(first.train) == 95
    assert sorted(first.train.ids + first.val.ids, key=int) == [str(i) for i in range(100)]
    other = data.load_splits(make_cfg(tmp_path, split_seed=1))
    assert other.val.ids != first.val.ids
    write_rows(tmp_path / "val.csv", 7, start=1000)
    given = data.load_splits(make_cfg(tmp_path, validation_csv=str(tmp_path / "val.csv")))
    assert len(given.train) == 100 and given.val.ids == [str(1000 + i) for i in range(7)]


def test_targets_are_the_summary_and_eos_token_by_token(tmp_path):
    rows = write_rows(tmp_path / "train.csv", 6)
    splits = data.load_splits(make_cfg(tmp_path, val_fraction=0.0))
    examples = splits.train
    x, y = data.collate(examples, np.arange(6))
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape and x.shape[1] % 8 == 0
    assert x.shape[1] == -(-int(examples.lengths.max() - 1) // 8) * 8
    for i, row in enumerate(rows):
        prompt = enc.encode_ordinary(PROMPT_TEMPLATE.format(dialogue=row["dialogue"]))
        sequence = prompt + enc.encode_ordinary(row["summary"]) + [EOT_ID]
        n = len(sequence) - 1
        assert x[i, :n].tolist() == sequence[:-1] and (x[i, n:] == EOT_ID).all()
        targets = y[i][y[i] != -1].tolist()
        assert targets == enc.encode_ordinary(row["summary"]) + [EOT_ID]
        assert (y[i, len(prompt) - 1:n] != -1).all() and (y[i, :len(prompt) - 1] == -1).all()
        assert (y[i, n:] == -1).all()
    _, y_all = data.collate(examples, np.arange(6), train_on_prompt=True)
    for i in range(6):
        sequence = examples.sequence(i).tolist()
        assert y_all[i][y_all[i] != -1].tolist() == sequence[1:]


def test_long_dialogue_is_cut_never_the_summary_header_or_cue(tmp_path):
    long_dialogue = dialogue(0, turns=60)
    summary = "Person0 talks about the plan for a very long time."
    pd.DataFrame({"id": [1, 2], "dialogue": [long_dialogue, "A: short."],
                  "summary": [summary, "Short."]}).to_csv(tmp_path / "train.csv", index=False)
    splits = data.load_splits(make_cfg(tmp_path, block_size=64, val_fraction=0.0, max_new_tokens=16))
    examples = splits.train
    assert examples.cut == 1 and any("cut the end of 1 dialogue" in note for note in splits.notes)
    head, tail = data.template_tokens(PROMPT_TEMPLATE)
    summary_tokens = enc.encode_ordinary(summary) + [EOT_ID]
    sequence = examples.sequence(0).tolist()
    prompt_len = int(examples.prompt_lens[0])
    # the one truncation rule: room for max_new_tokens of summary, so the prompt is what inference builds
    assert prompt_len == 64 - 16
    assert sequence[:len(head)] == head and sequence[prompt_len - len(tail):prompt_len] == tail
    assert sequence[prompt_len:] == summary_tokens
    assert (sequence[len(head):prompt_len - len(tail)]
            == enc.encode_ordinary(long_dialogue)[:prompt_len - len(head) - len(tail)])
    assert data.prompt_format(PROMPT_TEMPLATE, 64, 16).encode(long_dialogue) == (sequence[:prompt_len], True)
    x, y = data.collate(examples, [0])
    assert x.shape == (1, 64) and y[0][y[0] != -1].tolist() == summary_tokens


def test_a_summary_longer_than_max_new_tokens_cuts_its_dialogue_further_in_training(tmp_path):
    summary = "word " * 30  # 30 tokens + EOS, more than max_new_tokens=16
    pd.DataFrame({"id": [1], "dialogue": [dialogue(0, turns=60)], "summary": [summary]}).to_csv(
        tmp_path / "train.csv", index=False)
    examples = data.load_splits(make_cfg(tmp_path, block_size=64, val_fraction=0.0, max_new_tokens=16)).train
    assert len(examples.sequence(0)) == 64 + 1 and examples.prompt_lens[0] == 64 - 30


def test_summary_that_cannot_fit_is_skipped_and_counted(tmp_path):
    pd.DataFrame({"id": [1, 2], "dialogue": ["A: hi.", "B: yo."],
                  "summary": ["word " * 80, "Fine."]}).to_csv(tmp_path / "train.csv", index=False)
    splits = data.load_splits(make_cfg(tmp_path, block_size=64, val_fraction=0.0, max_new_tokens=16))
    assert splits.train.ids == ["2"] and splits.train.too_long == 1
    assert any("skipped 1 example(s) whose summary alone" in note for note in splits.notes)


def test_a_prompt_matches_the_plain_template_and_keeps_the_cue():
    text = "Amanda: I baked cookies. Do you want some?\r\nJerry: Sure! 🍪"
    prompt, cut = data.prompt_format(PROMPT_TEMPLATE, 1024, 24).encode(text)
    assert prompt == enc.encode_ordinary(PROMPT_TEMPLATE.format(dialogue=data.clean_text(text))) and not cut
    template = "Chat:\n{dialogue}\nTL;DR:"
    prompt, cut = data.prompt_format(template, 40, 28).encode(text)
    assert cut and len(prompt) == 12 and prompt[:3] == enc.encode_ordinary("Chat:\n")
    assert enc.decode(prompt).endswith("\nTL;DR:")
    assert "lower max_new_tokens below 32" in user_error(lambda: data.prompt_format(template, 40, 35))
    assert "max_new_tokens=1024" in user_error(lambda: data.prompt_format(PROMPT_TEMPLATE, 1024, 1024))


# ---- the tokenized cache ----------------------------------------------------------------------------------

def test_cache_is_reused_and_invalidated_by_csv_template_and_block_size(tmp_path, monkeypatch):
    calls = []
    original = data.tokenize_table
    monkeypatch.setattr(data, "tokenize_table", lambda *args, **kw: calls.append(1) or original(*args, **kw))
    write_rows(tmp_path / "train.csv", 20)
    cfg = make_cfg(tmp_path)
    first = data.load_splits(cfg)
    second = data.load_splits(cfg)
    assert len(calls) == 1 and np.array_equal(first.train.tokens, second.train.tokens)
    assert not [f for f in os.listdir(cfg.data_cache_dir) if ".tmp" in f]
    write_rows(tmp_path / "train.csv", 21)
    assert len(data.load_splits(cfg).train) + len(data.load_splits(cfg).val) == 21 and len(calls) == 2
    other_template = data.load_splits(make_cfg(tmp_path, prompt_template="Chat: {dialogue}\nSummary:"))
    assert len(calls) == 3 and enc.decode(other_template.train.sequence(0).tolist()).startswith("Chat: ")
    data.load_splits(make_cfg(tmp_path, block_size=128))
    assert len(calls) == 4 and len(os.listdir(cfg.data_cache_dir)) == 4


def test_main_rank_builds_the_cache_while_the_others_wait(tmp_path, monkeypatch):
    write_rows(tmp_path / "train.csv", 20)
    cfg = make_cfg(tmp_path)
    events = []
    original = data.tokenize_table
    monkeypatch.setattr(data, "tokenize_table", lambda *a, **kw: events.append("tokenize") or original(*a, **kw))

    def barrier():  # in a real job rank 0 reaches the barrier after writing the cache
        events.append("barrier")
        data.load_splits(cfg, is_main=True)

    worker = data.load_splits(cfg, is_main=False, barrier=barrier)
    assert events == ["barrier", "tokenize"]
    assert worker.train.ids == data.load_splits(cfg).train.ids


def test_a_rank_that_cannot_see_the_main_ranks_cache_stops_in_one_line(tmp_path):
    """Several nodes and no shared disk: the cache rank 0 wrote is not on this node's (before: a bare StopIteration)."""
    write_rows(tmp_path / "train.csv", 20)
    cfg = make_cfg(tmp_path)
    message = user_error(lambda: data.load_splits(cfg, is_main=False))
    assert message.startswith(f"data_cache_dir {cfg.data_cache_dir} holds no tokens of {cfg.train_csv} ") and \
        "--data_cache_dir=<a folder every node shares>" in message and "\n" not in message


# ---- sampling and batches ---------------------------------------------------------------------------------

def lognormal_lengths(n, seed=0):
    """SAMSum-like sequence lengths: median ~156, mean ~187, a long right tail up to 792."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(np.log(156), 0.6, n), 30, 792).astype(int)


def dealt(lengths, batch, micro_batch_size, world_size=1, targets=None):
    """deal's micro-batches of global batch `batch` (example indices), as example indices per rank, within the plan's
    micro-batch: micro_batch_size rows as wide as the longest of `lengths`, each with the most targets."""
    targets = lengths // 4 if targets is None else targets
    limits = micro_batch_size * data.padded_width(lengths.max() - 1), micro_batch_size * targets.max()
    ranks = data.deal(data.padded_width(lengths[batch] - 1), targets[batch], *limits, world_size)
    return [[batch[part] for part in parts] for parts in ranks]


def padded(lengths, micro_batches):
    return sum(len(b) * int(data.padded_width(lengths[b].max() - 1)) for b in micro_batches)


@pytest.mark.parametrize("micro_batch_size", [2, 4])
def test_ranks_together_see_what_one_process_sees_in_as_many_micro_batches_each(micro_batch_size):
    lengths = lognormal_lengths(37)
    batch_size = 16
    sampler = LengthGroupedSampler(lengths, batch_size, seed=3)
    counts = set()
    for step in range(12):
        batch = sampler.global_batch(step)
        for world_size in (1, 2, 4):
            per_rank = dealt(lengths, batch, micro_batch_size, world_size)
            assert len({len(batches) for batches in per_rank}) == 1  # every rank syncs at the same micro-step
            counts.add(len(per_rank[0]))
            assert sorted(i for batches in per_rank for b in batches for i in b) == sorted(batch.tolist())
    assert len(counts) > 1  # the count follows the lengths


def cost(widths, ends):
    return sum((b - a) * widths[b - 1] + data.MICRO_BATCH_COST for a, b in itertools.pairwise(ends))


def test_the_cut_is_the_least_padding_and_micro_batches_by_brute_force():
    """Of the cuts within the limits, the cheapest; of those, one without a one-row micro-batch where there is one
    (a compiled step would compile again for it)."""
    rng = np.random.default_rng(0)
    for _ in range(60):
        n = int(rng.integers(1, 9))
        widths = np.sort(rng.integers(1, 80, n)) * 8
        targets = rng.integers(1, 20, n)
        max_tokens, max_targets = int(rng.integers(1, 5)) * widths[-1], int(rng.integers(1, 4)) * targets.max()
        feasible = {1: {}, 2: {}}  # least rows -> micro-batch count -> costs of the cuts within the limits
        for inner in itertools.chain.from_iterable(itertools.combinations(range(1, n), k) for k in range(n)):
            ends = [0, *inner, n]
            parts = list(itertools.pairwise(ends))
            if all((b - a) * widths[b - 1] <= max_tokens and targets[a:b].sum() <= max_targets for a, b in parts):
                for least in (1, 2) if min(b - a for a, b in parts) >= 2 else (1,):
                    feasible[least].setdefault(len(parts), []).append(cost(widths, ends))
        found = data.cut(widths, targets, max_tokens, max_targets)
        best = feasible[2] or feasible[1]
        assert cost(widths, found) == min(map(min, best.values()))
        assert min(b - a for a, b in itertools.pairwise(found)) >= (2 if feasible[2] else 1)
        for count, costs in feasible[1].items():
            ends = data.cut(widths, targets, max_tokens, max_targets, count)
            assert len(ends) == count + 1 and cost(widths, ends) == min(feasible[2].get(count, costs))


@pytest.mark.parametrize("micro_batch_size", [1, 3, 16])
def test_no_micro_batch_holds_more_than_the_plans_rows_times_width_or_targets(micro_batch_size):
    lengths = lognormal_lengths(2000)
    targets = np.random.default_rng(1).integers(1, 80, len(lengths))
    sampler = LengthGroupedSampler(lengths, 64, seed=0)
    for step in range(10):
        for world_size in (1, 2):
            for batches in dealt(lengths, sampler.global_batch(step), micro_batch_size, world_size, targets):
                for b in batches:
                    assert padded(lengths, [b]) <= micro_batch_size * data.padded_width(lengths.max() - 1)
                    assert targets[b].sum() <= micro_batch_size * targets.max()


def test_resuming_at_step_k_continues_the_same_stream():
    lengths = lognormal_lengths(50)
    before = LengthGroupedSampler(lengths, 8, seed=5)
    stream = [before.global_batch(step).tolist() for step in range(30)]
    resumed = LengthGroupedSampler(lengths, 8, seed=5)
    assert [resumed.global_batch(step).tolist() for step in range(17, 30)] == stream[17:]
    reseeded = LengthGroupedSampler(lengths, 8, seed=6)
    assert [reseeded.global_batch(step).tolist() for step in range(30)] != stream


def test_every_example_is_seen_once_per_epoch_and_epochs_reshuffle():
    n, batch_size = 50, 8
    sampler = LengthGroupedSampler(lognormal_lengths(n), batch_size, seed=0)
    steps = n * 16 // batch_size  # 16 epochs end exactly at a step boundary
    seen = np.concatenate([sampler.global_batch(step) for step in range(steps)])
    assert np.array_equal(np.bincount(seen, minlength=n), np.full(n, 16))
    first, second = sampler.stream(0, n), sampler.stream(n, n)
    assert sorted(first) == sorted(second) == list(range(n)) and not np.array_equal(first, second)


def test_micro_batches_go_longest_first_and_balance_ranks():
    lengths = lognormal_lengths(4000)
    batch = LengthGroupedSampler(lengths, 256, seed=0).global_batch(0)
    batches, = dealt(lengths, batch, 8)
    assert all(lengths[a].max() >= lengths[b].max() for a, b in itertools.pairwise(batches))
    tokens = [padded(lengths, batches) for batches in dealt(lengths, batch, 8, 4)]
    assert max(tokens) / min(tokens) < 1.1


@pytest.mark.parametrize("micro_batch_size, most", [(256, 0.10), (16, 0.05)])
def test_cut_micro_batches_pad_little_on_samsum_like_lengths(micro_batch_size, most):
    lengths = lognormal_lengths(818)
    sampler = LengthGroupedSampler(lengths, 256, seed=0)
    batches = [b for step in range(8) for b in dealt(lengths, sampler.global_batch(step), micro_batch_size)[0]]
    assert 0 < 1 - (lengths[np.concatenate(batches)] - 1).sum() / padded(lengths, batches) <= most


def test_global_target_count_matches_the_ranks_batches(tmp_path):
    write_rows(tmp_path / "train.csv", 30)
    cfg = make_cfg(tmp_path, val_fraction=0.0, batch_size=16, micro_batch_size=2)
    train = data.load_splits(cfg).train
    for train_on_prompt in (False, True):
        cfg_t = make_cfg(tmp_path, val_fraction=0.0, batch_size=16, micro_batch_size=2, train_on_prompt=train_on_prompt)
        ranks = [TrainBatches(train, cfg_t, rank, 2) for rank in range(2)]
        for step in (0, 1, 5):
            both = [r(step) for r in ranks]
            batches = [xy for batch in both for xy in batch.micro_batches]
            assert len(both[0].micro_batches) == len(both[1].micro_batches)
            assert all(x.numel() <= 2 * data.padded_width(train.lengths.max() - 1) for x, _ in batches)
            assert sum(x.shape[0] for x, _ in batches) == 16
            assert both[0].positions == both[1].positions == sum(x.numel() for x, _ in batches)
            assert both[0].targets == both[1].targets == sum(int((y != -1).sum()) for _, y in batches)
            if train_on_prompt:  # every input token but padding is a target: the counts of the inputs
                rows = [int(n) for _, y in batches for n in (y != -1).sum(1)]
                assert both[0].tokens == both[1].tokens == sum(rows)
                assert both[0].attended == both[1].attended == sum(n * n for n in rows)


def test_eval_batches_cover_the_split_once(tmp_path):
    write_rows(tmp_path / "train.csv", 23)
    examples = data.load_splits(make_cfg(tmp_path, val_fraction=0.0)).train
    targets = examples.target_counts().sum()
    per_rank = [list(data.eval_batches(examples, 4, rank, 2)) for rank in range(2)]
    assert [len(b) for b in per_rank] == [3, 3]
    assert sum(int((y != -1).sum()) for batches in per_rank for _, y in batches) == targets
    limited = [list(data.eval_batches(examples, 4, rank, 2, max_batches=3)) for rank in range(2)]
    assert sum(x.shape[0] for batches in limited for x, _ in batches) == 12


@contextlib.contextmanager
def read_only(folder):
    """`folder` cannot be written while inside: a read-only bind mount for root (whom permissions do not stop),
    else its permissions."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        try:
            yield
        finally:
            os.chmod(folder, 0o755)
        return
    subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(folder)], check=True)
        yield
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_data_cache_folder_that_cannot_be_written_gives_way_to_one_under_out_dir(tmp_path):
    write_rows(tmp_path / "train.csv", 20)
    (tmp_path / "cache").mkdir()
    cfg = Config(train_csv=str(tmp_path / "train.csv"), data_cache_dir=str(tmp_path / "cache"),
                 out_dir=str(tmp_path / "out"), val_fraction=0.25, block_size=128, max_new_tokens=16)
    with read_only(tmp_path / "cache"):
        splits = data.load_splits(cfg)
        [note] = [note for note in splits.notes if "cannot be written" in note]
        assert note.startswith(f"data_cache_dir {tmp_path / 'cache'} cannot be written (")
        assert f"tokens cached in {tmp_path / 'out' / '.cache' / 'data'}" in note
        assert len(os.listdir(tmp_path / "out" / ".cache" / "data")) == 1
        assert data.load_splits(cfg).train.ids == splits.train.ids  # read back from there
    write_rows(tmp_path / "other.csv", 20, start=100)  # tokens not cached anywhere yet
    with read_only(tmp_path / "cache"), read_only(tmp_path / "out"):
        with pytest.raises(UserError, match="--data_cache_dir"):
            data.load_splits(Config(**{**cfg.__dict__, "train_csv": str(tmp_path / "other.csv")}))


@pytest.mark.slow
def test_a_read_only_checkout_trains_with_a_writable_out_dir(tmp_path):
    """The repository attached as a Kaggle dataset (read-only): the demo trains, its tokens cached under out_dir."""
    checkout = tmp_path / "repo"
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        os.makedirs(checkout / os.path.dirname(name), exist_ok=True)
        shutil.copy(os.path.join(REPO, name), checkout / name)
    out = tmp_path / "out"
    with read_only(checkout):
        result = subprocess.run([sys.executable, "train.py", "config/demo.py", "--max_iters=1", "--rouge_samples=0",
                                 "--best_metric=val_loss", "--evaluate_after=False", "--predict_after=False",
                                 f"--out_dir={out}"], cwd=checkout, capture_output=True, text=True, timeout=HANG,
                                env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1"))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "data_cache_dir .cache/data cannot be written" in result.stdout
    assert (out / "ckpt.pt").is_file() and os.listdir(out / ".cache" / "data")
