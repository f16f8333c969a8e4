"""The pure logic of stage 00: conversations answered turn by turn, as token ids.

No engine here: `regenerate` takes any object with the `Engine` protocol (vLLM in
vllm_runner.py; tests may pass their own), so the turn logic is testable alone.

Which turns are generated (eagle3/target/chats.py, `answer_slots`): every assistant turn of a
chat is regenerated, a trailing user turn gets a new answer after it, and a record of
user turns only (a prompt, a `turns` list, ...) gets one new answer after each user turn.
A conversation's assistant turns are generated in order, each in the context a server
gives it (eagle3/target/loss_mask.py, `Splicer`): the target's chat template rendered over
the served history, each earlier answer as a server returns it (`served_answer`: its
reasoning split off). While the template renders the earlier turns as they were
generated, the prompt of turn j is the generated ids of turns 0..j-1 spliced into the
template, which is exactly the token sequence stage 01 builds from the output; when it
rewrites one (a thinking template dropping the reasoning of history turns), turn j's
prompt is the tokenized served history and turn j becomes a training sample of its
own. Either way the target is conditioned on what the drafter will train on. User and
system turns stay as they were.

Per round, every unfinished conversation of a chunk contributes its next turn's
prompt, and all of them go to the engine in one call (vLLM batches them). Each
request's seed derives from (seed, sample id, turn) only, so a sampled answer does
not depend on batching, order, shards or resume.

What ends a conversation early, counted by reason and never dropped silently:
    prompt_too_long   the turn's prompt leaves no room in the context
    empty_answer      the target's answer is empty (only its stop token, or whitespace)
The conversation is kept up to the turn before (dropped when that is its first turn);
the turns it never reached are counted by reason too (`turns_not_generated`). Answers
cut by max_new_tokens are kept (counted as `cut_answers`).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from eagle3.target.chats import BadRecord, RawRecord, answer_slots, record_turns, sample_id
from eagle3.target.loss_mask import Answer, Splicer

PROMPT_TOO_LONG = "prompt_too_long"
EMPTY_ANSWER = "empty_answer"


def request_seed(seed: int, sid: str, turn: int) -> int:
    """A request's sampling seed from (seed, sample id, turn): independent of batching and order."""
    h = hashlib.sha256(f"{seed}:{sid}:{turn}".encode()).digest()
    return int.from_bytes(h[:4], "big") & 0x7FFFFFFF


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    seed: int


@dataclass
class Generation:
    ids: list[int]  # generated ids, with the stop token when generation stopped on one
    finish_reason: str  # "stop" or "length"


class Engine(Protocol):
    max_model_len: int

    def set_sampling(self, temperature: float, top_p: float, stop_ids: Sequence[int]) -> None: ...

    def generate(self, requests: Sequence[Request]) -> list[Generation]: ...


@dataclass
class Turns:
    """What the template needs to know to regenerate: its switches, suffix and stop tokens."""

    tok: object
    suffix: list[int]  # the template's tokens after an assistant message (eagle3/target/loss_mask.py)
    template_kwargs: dict
    stop_ids: set[int]  # ids that end a turn (the end-of-turn token, the model's eos)

    def decode(self, ids: Sequence[int], finished: bool) -> str:
        """An answer's text (markup such as <think> kept) without the stop token it ended on."""
        body = list(ids[:-1]) if finished and ids and ids[-1] in self.stop_ids else list(ids)
        return self.tok.decode(body, skip_special_tokens=False)


@dataclass
class Conversation:
    sample_id: str
    where: str
    messages: list[dict]  # assistant contents become the decoded answers as turns finish
    turns: list[int]  # message index of each assistant turn to generate
    source_turns: int = 0  # assistant turns the input record had (regenerated); the others are new
    answers: list[Answer] = field(default_factory=list)
    finish_reasons: list[str] = field(default_factory=list)
    stopped: str | None = None  # why regeneration ended before the last turn
    splicer: Splicer | None = field(default=None, repr=False)  # the samples so far (built turn by turn)

    @property
    def done(self) -> bool:
        return self.stopped is not None or len(self.answers) == len(self.turns)

    def prompt_ids(self, turns: Turns) -> list[int]:
        """The next turn's prompt (`turn_prompt(..., turn=j)`), built on the turns before."""
        if self.splicer is None:
            self.splicer = Splicer(turns.tok, turns.suffix, turns.template_kwargs)
        assert self.splicer.turns == len(self.answers), "one prompt per turn, then its answer"
        return list(self.splicer.head(self.messages, self.turns[len(self.answers)]))

    def add(self, turns: Turns, gen: Generation) -> None:
        finished = gen.finish_reason != "length"
        text = turns.decode(gen.ids, finished)
        if not text.strip():
            self.stopped = EMPTY_ANSWER
            return
        j = len(self.answers)
        self.messages[self.turns[j]] = {"role": "assistant", "content": text}
        self.answers.append(Answer(list(gen.ids), finished))
        self.splicer.answer(self.messages, self.turns[j], self.answers[-1])
        self.finish_reasons.append(gen.finish_reason)

    def record(self) -> dict:
        """The output line: the regenerated conversation, or why nothing is left of it.

        `samples`: the conversation's training samples (eagle3/target/loss_mask.py), each by the
        turn its context leads to first and that context's length in tokens (the prompt the
        target answered it after); stage 01 rebuilds them and checks both. `turns_planned`:
        the assistant turns the record asked for, generated or not."""
        n = len(self.answers)
        if n == 0:
            return {"sample_id": self.sample_id, "source": self.where, "dropped": self.stopped,
                    "turns_planned": len(self.turns)}
        end = self.turns[n - 1] + 1  # up to the last regenerated turn; later turns were not answered
        return {
            "sample_id": self.sample_id, "source": self.where, "messages": self.messages[:end],
            "generated": [{"ids": a.ids, "finish_reason": r} for a, r in zip(self.answers, self.finish_reasons)],
            "samples": [{"first_turn": s.first_turn, "prompt_tokens": s.prompt_tokens}
                        for s in self.splicer.answered()],
            "stopped": self.stopped, "assistant_turns_in_source": self.source_turns, "turns_planned": len(self.turns),
        }


def from_raw(raw: RawRecord, prompt_field: str | None = None) -> Conversation | dict:
    """A conversation to answer, or the output line of a bad input record.

    `prompt_field`: the record field holding the prompt (--prompt-field); by default the
    shapes of eagle3/target/chats.py, `record_turns`."""
    try:
        source = record_turns(raw.record, prompt_field)
        messages, turns = answer_slots(source)
    except BadRecord as e:
        sid = sample_id(raw) if isinstance(raw.record, dict) else f"{raw.where}"
        return {"sample_id": sid, "source": raw.where, "bad": e.reason, "detail": e.detail}
    return Conversation(sample_id(raw), raw.where, messages, turns,
                        source_turns=sum(m["role"] == "assistant" for m in source))


def regenerate(convs: list[Conversation], engine: Engine, t: Turns, *, max_new_tokens: int, seed: int,
               on_round: Callable[[int, int], None] = lambda turns, tokens: None) -> None:
    """Regenerate every conversation's assistant turns in rounds: turn 0 of all, then turn 1, ...

    `on_round(turns_done, tokens_generated)` after each engine call (progress).
    """
    while True:
        batch: list[tuple[Conversation, Request]] = []
        for c in convs:
            if c.done:
                continue
            prompt = c.prompt_ids(t)
            room = engine.max_model_len - len(prompt)
            if room < 1:
                c.stopped = PROMPT_TOO_LONG
                continue
            batch.append((c, Request(prompt, min(max_new_tokens, room),
                                     request_seed(seed, c.sample_id, len(c.answers)))))
        if not batch:
            return
        gens = engine.generate([r for _, r in batch])
        for (c, _), g in zip(batch, gens):
            c.add(t, g)
        on_round(len(batch), sum(len(g.ids) for g in gens))
