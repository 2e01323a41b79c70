"""The embedded corpus, a byte-level tokenizer and the datasets the recipes train on. No downloads.

Corpus: the Python standard library's `pydoc_data.topics` -- the "Python Language Reference" topics that `help()`
shows (79 topics, ~465K characters of English technical prose on CPython 3.11; the exact text follows the Python
you run). It ships with every CPython, so a fresh clone trains with nothing fetched. Licence: PSF License
Agreement (Python Software Foundation License Version 2), which permits use and redistribution; see
docs/launch.md.

Tokenizer: raw UTF-8 bytes (ids 0..255) plus three specials. Honest and tiny: loss in nats/byte, no merges to train.
"""
from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

CORPUS_LICENSE = "PSF-2.0 (Python Software Foundation License Version 2), text of CPython's pydoc_data.topics"


def corpus_topics() -> dict[str, str]:
    """name -> text, sorted by name so every rank and every run sees the same order."""
    from pydoc_data.topics import topics
    return {name: topics[name] for name in sorted(topics)}


def corpus_text() -> str:
    return "\n\n".join(corpus_topics().values())


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then <bos>, <eos>, <pad>. `vocab_size` is what the model's embedding needs."""
    bos_id, eos_id, pad_id = 256, 257, 258
    vocab_size = 259

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (loaded from a local folder) behind ByteTokenizer's small interface."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.bos_id, self.eos_id = self.tok.bos_token_id, self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return ([self.bos_id] if bos and self.bos_id is not None else []) + ids + (
            [self.eos_id] if eos and self.eos_id is not None else [])

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


class PackedLMDataset(Dataset):
    """The corpus as one token stream cut into fixed windows of seq_len tokens (documents joined by <eos>).

    `labels` equal `input_ids`: Hugging Face causal-LM heads shift them internally. The last `val_fraction` of the
    stream is held out (split="val")."""

    def __init__(self, seq_len: int = 128, split: str = "train", val_fraction: float = 0.05,
                 tokenizer: ByteTokenizer | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}: expected 'train' or 'val'")
        tok = tokenizer or ByteTokenizer()
        ids: list[int] = []
        for text in corpus_topics().values():
            ids += tok.encode(text, eos=True)
        stream = torch.tensor(ids, dtype=torch.long)
        cut = int(len(stream) * (1 - val_fraction))
        stream = stream[:cut] if split == "train" else stream[cut:]
        n = len(stream) // seq_len
        if n == 0:
            raise ValueError(f"seq_len={seq_len} is longer than the {split} split ({len(stream)} tokens)")
        self.blocks = stream[: n * seq_len].view(n, seq_len)
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.blocks[i]
        return {"input_ids": x, "labels": x.clone()}


class InstructionDataset(Dataset):
    """A small supervised fine-tuning set made from the same corpus, and honest about it: the prompt asks for the
    reference entry of a topic name, the answer is the start of that entry. One example per topic (79 on 3.11),
    each padded to max_len; loss only on answer tokens (prompt and padding labelled -100, as HF expects)."""

    TEMPLATE = "### Question: What does the Python language reference say under '{name}'?\n### Answer: "

    def __init__(self, max_len: int = 256, tokenizer=None):
        self.tok = tokenizer or ByteTokenizer()
        self.max_len = max_len
        self.examples = [self._encode(name, text) for name, text in corpus_topics().items()]

    def _encode(self, name: str, text: str) -> dict[str, torch.Tensor]:
        prompt = self.tok.encode(self.TEMPLATE.format(name=name), bos=True)
        answer = self.tok.encode(text, eos=True)[: max(1, self.max_len - len(prompt))]
        ids = (prompt + answer)[: self.max_len]
        labels = ([-100] * len(prompt) + answer)[: self.max_len]
        pad = self.max_len - len(ids)
        return {"input_ids": torch.tensor(ids + [self.tok.pad_id] * pad),
                "attention_mask": torch.tensor([1] * len(ids) + [0] * pad),
                "labels": torch.tensor(labels + [-100] * pad)}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


def build_loader(dataset: Dataset, micro_batch_size: int, *, rank: int = 0, world_size: int = 1, seed: int = 0,
                 shuffle: bool = True, drop_last: bool = True) -> DataLoader:
    """One DataLoader per rank over its DistributedSampler slice; call loader.sampler.set_epoch(e) each epoch."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, drop_last=drop_last)
