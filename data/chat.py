"""The chat format of SFT, RL and distillation: turns framed by role tokens, special tokens
inserted by id (text is encoded literally, so data can never forge a role), the reasoning
effort (1-100) in the system prompt.

  <|bos|><|system|>Reasoning Effort: 75<|end_of_turn|><|user|>What is 3 + 5?<|end_of_turn|>
  <|assistant|><|think|>3 + 5 = 8<|/think|>8<|end_of_turn|>

An assistant turn is `reasoning` inside <|think|> ... <|/think|> (empty at low effort), then the
answer, then <|end_of_turn|>. The loss covers assistant turns only: their content and the
closing <|end_of_turn|>, never the role token that opens them (the prompt supplies it).
A generation prompt ends with <|assistant|>; generation stops at <|end_of_turn|> or <|eos|>.

The content of a system, user or tool turn may be segments instead of one string: strings and
images (anything data/images.open_image reads, never a str), in reading order. `pieces` lays such a
conversation out; data/sft.py turns its images into image spans (data/images.py), which are never
in the loss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

from data.errors import DataError

EFFORT_MIN, EFFORT_MAX = 1, 100
ROLES = ("system", "user", "assistant", "tool")


def system_prompt(effort: int) -> str:
    if not EFFORT_MIN <= effort <= EFFORT_MAX:
        raise DataError(f"reasoning effort {effort} is outside {EFFORT_MIN}-{EFFORT_MAX}")
    return f"Reasoning Effort: {effort}"


@dataclass
class Message:
    role: str  # system | user | assistant | tool
    content: Union[str, list[Any]]  # the answer, for an assistant turn; or segments (module docstring)
    reasoning: Optional[str] = None  # assistant only: the text inside <|think|> ... <|/think|>

    @property
    def images(self) -> list[Any]:
        return [] if isinstance(self.content, str) else [s for s in self.content if not isinstance(s, str)]


class ChatFormat:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        t = tokenizer.token_id
        self.bos, self.eos = tokenizer.bos_id, tokenizer.eos_id
        self.role = {r: t(f"<|{r}|>") for r in ROLES}
        self.eot, self.think, self.end_think = t("<|end_of_turn|>"), t("<|think|>"), t("<|/think|>")

    def encode(self, messages: list[Message], effort: Optional[int] = None) -> tuple[list[int], list[bool]]:
        """A conversation -> (token ids, loss mask: True on assistant content and its
        <|end_of_turn|>). `effort`: a system turn "Reasoning Effort: {effort}" goes first (a
        conversation may not have its own system turn as well)."""
        ids, mask = [], []
        for piece in self.pieces(messages, effort):
            if not isinstance(piece, tuple):
                raise DataError("the conversation has images: data/sft.py lays out image conversations")
            ids += piece[0]
            mask += [piece[1]] * len(piece[0])
        return ids, mask

    def pieces(self, messages: list[Message], effort: Optional[int] = None) -> list[Any]:
        """The conversation in reading order as (token ids, in the loss?) runs of text and, where a
        turn's content segments put them, its images (`encode` without images)."""
        if effort is not None:
            if any(m.role == "system" for m in messages):
                raise DataError("a conversation with a system turn cannot also take an effort")
            messages = [Message("system", system_prompt(effort)), *messages]
        out: list[Any] = [([self.bos], False)]
        for m in messages:
            if m.role not in self.role:
                raise DataError(f"unknown chat role {m.role!r} (expected one of {', '.join(ROLES)})")
            if m.role == "assistant":
                if not isinstance(m.content, str):
                    raise DataError("an assistant turn's content is text: images go in system, user or tool "
                                    "turns")
                out += [([self.role[m.role]], False),
                        (self.assistant_body(m.content, m.reasoning) + [self.eot], True)]
                continue
            out.append(([self.role[m.role]], False))
            for segment in [m.content] if isinstance(m.content, str) else m.content:
                out.append((self.tok.encode(segment), False) if isinstance(segment, str) else segment)
            out.append(([self.eot], False))
        return out

    def assistant_body(self, answer: str, reasoning: Optional[str]) -> list[int]:
        think = [self.think, *self.tok.encode(reasoning or ""), self.end_think]
        return think + self.tok.encode(answer)

    def prompt(self, user: str, effort: Optional[int] = None,
               history: Optional[list[Message]] = None) -> list[int]:
        """Ids of a generation prompt: the conversation so far, the user turn, then <|assistant|>."""
        ids, _ = self.encode([*(history or []), Message("user", user)], effort)
        return ids + [self.role["assistant"]]

    def stop_ids(self) -> set[int]:
        return {self.eot, self.eos}

    def parse_response(self, ids: list[int]) -> tuple[str, str]:
        """Generated ids (after <|assistant|>) -> (reasoning, answer) text. Stops at the first
        stop token; without a <|/think|> the whole response counts as reasoning (no answer)."""
        stop = self.stop_ids()
        end = next((i for i, t in enumerate(ids) if t in stop), len(ids))
        ids = ids[:end]
        if self.end_think not in ids:
            return self.tok.decode([t for t in ids if t != self.think]), ""
        cut = ids.index(self.end_think)
        reasoning = [t for t in ids[:cut] if t != self.think]
        return self.tok.decode(reasoning), self.tok.decode(ids[cut + 1:], skip_special_tokens=True)
