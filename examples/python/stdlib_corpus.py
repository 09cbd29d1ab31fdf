"""Real text every machine has offline: the Python standard library's own
source files, tokenised with a byte-level BPE trained on them once and cached.

The corpus is every ``*.py`` file under sysconfig's stdlib path, less
site-packages and the test suites (``test``/``tests``/``idle_test``: long runs of
generated test data), in sorted order. Train and held-out are split by file
(a file's CRC-32 of its relative path, one in ``HELDOUT_ONE_IN``), so that
no held-out line was ever seen in training. Files are joined with an
end-of-text token.

The cache (under ``cache_dir``, by default ~/.cache/shardtorch/stdlib_corpus)
holds the tokenizer (``tokenizers``' own JSON) and the token ids of both
splits, keyed by the Python version, the corpus size and the vocabulary, so
another Python or another ``--vocab`` never reads a stale cache.
"""
import hashlib
import os
import sysconfig
import zlib

import torch

END_OF_TEXT = "<|endoftext|>"
HELDOUT_ONE_IN = 20
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def default_cache_dir():
    return os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "shardtorch",
                        "stdlib_corpus")


def source_files(max_bytes=0):
    """[(relative path, text)] of the corpus in sorted order; ``max_bytes`` > 0
    keeps about that many bytes (small runs, tests): the first training files
    up to its share and the first held-out files up to theirs, so that both
    splits have some."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in SKIPPED_DIRS)
        paths.extend(os.path.join(directory, n) for n in names if n.endswith(".py"))
    budget = {True: max_bytes / HELDOUT_ONE_IN, False: max_bytes - max_bytes / HELDOUT_ONE_IN}
    files = []
    for path in sorted(paths):
        name = os.path.relpath(path, root)
        if max_bytes and budget[is_heldout(name)] <= 0:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if text.strip():
            files.append((name, text))
            budget[is_heldout(name)] -= len(text)
        if max_bytes and max(budget.values()) <= 0:
            break
    return files


def is_heldout(relative_path):
    return zlib.crc32(relative_path.encode()) % HELDOUT_ONE_IN == 0


def _cache_key(files, vocab):
    digest = hashlib.sha256()
    for name, text in files:
        digest.update(name.encode())
        digest.update(len(text).to_bytes(8, "little"))
    return f"py{sysconfig.get_python_version()}-{digest.hexdigest()[:12]}-v{vocab}"


def _paths(cache_dir, key):
    return os.path.join(cache_dir, f"bpe-{key}.json"), os.path.join(cache_dir, f"tokens-{key}.pt")


def build(vocab, cache_dir=None, max_bytes=0, log=print):
    """Trains the tokenizer and tokenises both splits unless the cache holds
    them; returns the cache paths (tokenizer, tokens). Call it on one process
    (the others wait, then call ``load``)."""
    from tokenizers import ByteLevelBPETokenizer

    cache_dir = cache_dir or default_cache_dir()
    files = source_files(max_bytes)
    key = _cache_key(files, vocab)
    tokenizer_path, tokens_path = _paths(cache_dir, key)
    if os.path.exists(tokenizer_path) and os.path.exists(tokens_path):
        return tokenizer_path, tokens_path
    os.makedirs(cache_dir, exist_ok=True)
    train = [text for name, text in files if not is_heldout(name)]
    heldout = [text for name, text in files if is_heldout(name)]
    if not train or not heldout:
        raise ValueError(f"the corpus of {len(files)} files has {len(train)} training and {len(heldout)} held-out "
                         f"files: both splits need at least one (raise the corpus size)")
    log(f"corpus: training a byte-level BPE of {vocab} tokens on {len(train)} stdlib files "
        f"({sum(map(len, train)) / 2**20:.1f} MiB; {len(heldout)} files held out), cached in {cache_dir}")
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(train, vocab_size=vocab, min_frequency=2, special_tokens=[END_OF_TEXT],
                                  show_progress=False)
    end = tokenizer.token_to_id(END_OF_TEXT)
    splits = {}
    for split, texts in (("train", train), ("heldout", heldout)):
        ids = []
        for encoding in tokenizer.encode_batch(texts):
            ids.extend(encoding.ids)
            ids.append(end)
        splits[split] = torch.tensor(ids, dtype=torch.int32)
    # Written to temporary names then renamed: a run killed mid-way leaves no half cache.
    tokenizer.save(tokenizer_path + ".tmp")
    torch.save(splits, tokens_path + ".tmp")
    os.replace(tokens_path + ".tmp", tokens_path)
    os.replace(tokenizer_path + ".tmp", tokenizer_path)
    return tokenizer_path, tokens_path


def load(tokens_path):
    """{"train": int64 ids, "heldout": int64 ids}."""
    splits = torch.load(tokens_path, weights_only=True)
    return {split: ids.long() for split, ids in splits.items()}


class TokenBatches:
    """Training batches of ``seq_len`` consecutive tokens at random offsets;
    the batch of a step is a pure function of (seed, step, replica), so a
    resumed run sees exactly the data an uninterrupted one would. Held-out
    windows are fixed: consecutive, non-overlapping, from the start."""

    def __init__(self, splits, seq_len, seed):
        self.train, self.heldout, self.seq_len, self.seed = splits["train"], splits["heldout"], seq_len, seed
        for split, ids in splits.items():
            if len(ids) <= seq_len:
                raise ValueError(f"--seq-len must be below the {split} split's {len(ids)} tokens, got {seq_len}")

    def batch(self, step, replica, batch_size):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + replica)
        starts = torch.randint(len(self.train) - self.seq_len, (batch_size,), generator=g)
        return torch.stack([self.train[s:s + self.seq_len] for s in starts.tolist()])

    def heldout_windows(self, count):
        """The first ``count`` held-out windows (fewer when the split is short)."""
        count = min(count, len(self.heldout) // self.seq_len)
        return self.heldout[:count * self.seq_len].view(count, self.seq_len)
