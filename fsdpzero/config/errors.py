"""One error type for every bad config, listing each problem with its key path and a fix."""
from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class Problem:
    key: str            # dotted path, "" for the file as a whole
    message: str
    suggestion: str = ""

    def __str__(self) -> str:
        where = self.key or "<config>"
        return f"{where}: {self.message}" + (f" -> {self.suggestion}" if self.suggestion else "")

    def to_dict(self) -> dict:
        return {"key": self.key, "message": self.message, "suggestion": self.suggestion}


class ConfigError(ValueError):
    """Raised once per config with every problem found (never a pydantic traceback)."""

    def __init__(self, problems: Iterable[Problem] | Problem | str, key: str = "", suggestion: str = ""):
        if isinstance(problems, str):
            problems = [Problem(key, problems, suggestion)]
        elif isinstance(problems, Problem):
            problems = [problems]
        self.problems: list[Problem] = list(problems)
        n = len(self.problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid DeepSpeed config ({n} problem{'s' if n != 1 else ''}):\n{lines}")

    def to_list(self) -> list[dict]:
        return [p.to_dict() for p in self.problems]


def brief(v: Any, limit: int = 60) -> str:
    """repr for messages, cut to one short line (a 4000-digit integer must not flood the terminal)."""
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**100:
        try:
            return f"<a {len(str(abs(v)))}-digit integer>"
        except ValueError:                     # str() refuses more than 4300 digits
            return "<an integer of more than 4300 digits>"
    text = repr(v)
    return text if len(text) <= limit else f"{text[:limit - 15]}...({len(text)} chars)"


def closest(word: str, candidates: Iterable[str], cutoff: float = 0.75) -> str | None:
    """The nearest valid key, or None. Case and '-'/'_' differences count as near."""
    cands = list(candidates)
    norm = {c.lower().replace("-", "_"): c for c in cands}
    w = word.lower().replace("-", "_")
    if w in norm:
        return norm[w]
    hit = difflib.get_close_matches(w, list(norm), n=1, cutoff=cutoff)
    return norm[hit[0]] if hit else None


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.75) -> str:
    hit = closest(word, candidates, cutoff)
    return f"did you mean `{hit}`?" if hit else ""
