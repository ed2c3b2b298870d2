"""The deterministic request workload of the `equivalence` stage (a CacheBlend-style reuse experiment).

A leader prompt (a short preamble, then four text segments back to back) saves the attention state of
each segment; four children contain the same four segments at other positions, in other orders, between
private text of their own, and end with a question about one fact of one segment. Reuse is judged by
position, so token accounting is exact by ids: every piece (segment, private gap, question) is encoded
standalone and the prompt is the concatenation of those id lists, never a re-tokenized string. All text
is generated here from word lists and a seeded `random.Random` (no downloads, no global state): same
seed -> the same ids, another seed -> other names, numbers and positions.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import random
import re
from dataclasses import asdict, dataclass, replace
from typing import Any, Iterator, Protocol, Sequence

from kmesh.errors import KMeshError


class WorkloadError(KMeshError):
    """The workload cannot be built as specified; the message says which constraint failed."""


class Tokenizer(Protocol):
    """Text <-> ids. `prefix_ids`/`suffix_ids` (optional, default empty) wrap a child's body in a chat turn."""

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...


class HFTokenizer:
    """Adapter around a Hugging Face tokenizer; the chat template is split at a marker into prefix/suffix ids."""

    MARKER = "KMESHUSERCONTENT"

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.prefix_ids: tuple[int, ...] = ()
        self.suffix_ids: tuple[int, ...] = ()
        self.chat_template = False
        try:
            msgs = [{"role": "user", "content": self.MARKER}]
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
            full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        except Exception:  # no template (or a broken one): plain prompts, no chat turn
            return
        full = full["input_ids"] if hasattr(full, "keys") else full
        full = full[0] if full and isinstance(full[0], list) else full
        if not isinstance(text, str) or text.count(self.MARKER) != 1:
            return
        head, tail = text.split(self.MARKER)
        pre, suf = self.encode(head), self.encode(tail)
        # Only trust the split when it decodes back to the template and tokenizes like the whole of it.
        whole = pre + self.encode(self.MARKER) + suf
        if whole == list(full) and self.decode(whole) == text:
            self.prefix_ids, self.suffix_ids, self.chat_template = tuple(pre), tuple(suf), True

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


class ByteTokenizer:
    """UTF-8 bytes -> ids `offset + byte`, for seeded-random-weight models that ship no tokenizer."""

    prefix_ids: tuple[int, ...] = ()
    suffix_ids: tuple[int, ...] = ()

    def __init__(self, vocab_size: int, offset: int = 0) -> None:
        if offset < 0 or offset + 256 > vocab_size:
            raise ValueError(f"ByteTokenizer needs offset >= 0 and offset + 256 <= vocab_size "
                             f"(offset {offset}, vocab_size {vocab_size})")
        self.vocab_size, self.offset = vocab_size, offset

    def encode(self, text: str) -> list[int]:
        return [self.offset + b for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        # A model may emit any id of its vocabulary: an id that is no byte decodes as U+FFFD.
        parts, run = [], bytearray()
        for i in ids:
            if 0 <= i - self.offset < 256:
                run.append(i - self.offset)
            else:
                parts += [run.decode("utf-8", errors="replace"), "\ufffd"]
                run = bytearray()
        return "".join(parts) + run.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class WorkloadSpec:
    prompt_tokens: int = 512                    # every child prompt is exactly this long, chat template included
    segment_tokens: tuple[int, ...] = (128, 112, 96, 80)
    children: int = 4
    block_size: int = 16
    leader_preamble_tokens: int = 16            # leader = preamble + segments back to back, block aligned

    def scaled(self, prompt_tokens: int) -> WorkloadSpec:
        """Same segment proportions at another prompt length, each rounded to a block multiple (>= 1 block);
        the leader preamble keeps its length (it only offsets the leader's segment starts)."""
        f, b = prompt_tokens / self.prompt_tokens, self.block_size
        segs = tuple(max(b, round(s * f / b) * b) for s in self.segment_tokens)
        return replace(self, prompt_tokens=prompt_tokens, segment_tokens=segs)

    def validate(self) -> None:
        b, segs = self.block_size, self.segment_tokens
        if b < 1 or self.children < 1 or not segs:
            raise WorkloadError(f"need block_size >= 1, children >= 1 and segments (got {self})")
        bad = [s for s in segs if s <= 0 or s % b]
        if bad or self.leader_preamble_tokens < 0 or self.leader_preamble_tokens % b:
            raise WorkloadError(f"segment tokens {segs} and leader preamble {self.leader_preamble_tokens} "
                                f"must be positive multiples of block_size {b} (preamble may be 0)")
        if sum(segs) + len(segs) + 1 > self.prompt_tokens:
            raise WorkloadError(f"segments {segs} (sum {sum(segs)}) plus one private token per gap "
                                f"({len(segs) + 1}) exceed prompt_tokens {self.prompt_tokens}")


@dataclass(frozen=True)
class Segment:
    name: str                   # the entity the document is about
    ids: tuple[int, ...]        # encoded standalone: exactly what the leader saves
    text: str                   # decode(ids)
    leader_start: int           # a multiple of block_size

    @property
    def tokens(self) -> int:
        return len(self.ids)


@dataclass(frozen=True)
class Placement:
    segment: int                # index into Workload.segments
    start: int                  # first position in the child prompt
    tokens: int                 # the segment's length

    @property
    def end(self) -> int:
        return self.start + self.tokens


@dataclass(frozen=True)
class Child:
    name: str
    ids: tuple[int, ...]
    placements: tuple[Placement, ...]   # in prompt order
    question: str
    answer: str
    asks: int                           # index of the segment the question is about

    def segment_slices(self) -> list[tuple[int, int, int]]:
        return [(p.segment, p.start, p.end) for p in sorted(self.placements, key=lambda p: p.start)]

    def restored_positions(self) -> list[int]:
        return sorted(i for p in self.placements for i in range(p.start, p.end))

    def private_positions(self) -> list[int]:
        restored = set(self.restored_positions())
        return [i for i in range(len(self.ids)) if i not in restored]


@dataclass(frozen=True)
class Workload:
    spec: WorkloadSpec | RagSpec
    seed: int
    leader_ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    children: tuple[Child, ...]

    def sha256(self) -> str:
        ids = [list(self.leader_ids), [list(s.ids) for s in self.segments], [list(c.ids) for c in self.children]]
        return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"spec": asdict(self.spec), "seed": self.seed, "leader_tokens": len(self.leader_ids),
                "segments": [{"name": s.name, "tokens": s.tokens, "leader_start": s.leader_start}
                             for s in self.segments],
                "children": [{"name": c.name, "tokens": len(c.ids), "slices": c.segment_slices(),
                              "private_tokens": len(c.private_positions()), "asks": c.asks,
                              "question": c.question, "answer": c.answer} for c in self.children],
                "sha256": self.sha256()}


# --- text generation -------------------------------------------------------------------------------------
_SYL = ("vel", "mor", "an", "sa", "ot", "ri", "ka", "len", "dor", "is", "tal", "bre", "quin", "ash", "fen",
        "lo", "mar", "ne", "or", "thu", "gal", "vi", "ser", "um", "pel", "ro", "dan", "ke", "sil", "var")
_FIRST = ("Ilse", "Tomas", "Mirela", "Anouk", "Bram", "Katya", "Oren", "Lidia", "Pavel", "Sena", "Joris",
          "Imke", "Radu", "Elin", "Tobias", "Yara", "Nils", "Greta", "Milan", "Ada")
# kind: (sentence with the place R and number P, sentence with the year Y and person F, questions by slot)
_KINDS = {
    "town": ("{N} is a town on the river {R}, with a population of {P}.",
             "It was founded in {Y} by the merchant {F}.",
             {"P": "What is the population of {N}?", "R": "On which river does {N} lie?",
              "Y": "In which year was {N} founded?", "F": "Who founded {N}?"}),
    "company": ("{N} is a firm in the port of {R} that employs {P} people.",
                "It was started in {Y} by the engineer {F}.",
                {"P": "How many people does {N} employ?", "R": "In which port is {N} based?",
                 "Y": "In which year was {N} started?", "F": "Who started {N}?"}),
    "ship": ("The ship {N} sails from {R} and has carried {P} passengers.",
             "It was launched in {Y} under the captain {F}.",
             {"P": "How many passengers has the ship {N} carried?", "R": "From which port does the ship {N} sail?",
              "Y": "In which year was the ship {N} launched?", "F": "Who was the captain of the ship {N}?"}),
    "library": ("The {N} library in {R} holds {P} books.",
                "It was opened in {Y} by the scholar {F}.",
                {"P": "How many books does the {N} library hold?", "R": "In which city is the {N} library?",
                 "Y": "In which year was the {N} library opened?", "F": "Who opened the {N} library?"}),
}
_HINT = {"P": "Give only the number.", "R": "Give only the name.", "Y": "Give only the year.",
         "F": "Give only the name."}
_ADJ = ("quiet", "narrow", "painted", "old", "busy", "green", "stone", "wooden", "crowded", "bright", "tall")
_THING = ("bridge", "market", "harbour", "tower", "square", "garden", "archive", "workshop", "canal", "hall")
_FILL = ("{It} is known for its {a} {t}.", "Visitors often mention the {a} {t} and the {b} {u}.",
         "Local records call {s} the busiest time of the year.", "A small museum near the {t} tells its story.",
         "Many stories about {N} mention the {a} {t}.", "The {a} {t} was rebuilt after a storm one {s}.",
         "In {s} the {t} is decorated with {a} lanterns.", "Guides say the {a} {u} is worth a slow walk.")
_INTRO = ("Read the documents below and answer the question at the end.",
          "Here are some short reference notes, followed by one question.",
          "The following texts describe places, firms, ships and libraries. A question follows.",
          "Use the notes below to answer the final question.")
_SEASONS = ("spring", "summer", "autumn", "winter")
_TEMPLATE_TEXT = " ".join([*_FILL, *_INTRO, *_HINT.values(), *(t for k in _KINDS.values() for t in k[:2]),
                           *(q for k in _KINDS.values() for q in k[2].values())])


class _Text:
    """Seeded generator of documents whose names and numbers never contain one another (so an answer
    string occurs only in the document it belongs to)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, []

    def _fresh(self, draw) -> str:
        while True:
            s = draw()
            if s not in _TEMPLATE_TEXT and not any(s in u or u in s for u in self.used):
                self.used.append(s)
                return s

    def _word(self) -> str:
        return "".join(self.rng.choice(_SYL) for _ in range(self.rng.randint(2, 3))).capitalize()

    def doc(self) -> tuple[str, list[str], dict[str, tuple[str, str]]]:
        """(entity name, two fact sentences, slot -> (question, answer))."""
        r, kind = self.rng, self.rng.choice(sorted(_KINDS))
        s1, s2, qs = _KINDS[kind]
        v = {"N": self._fresh(self._word), "R": self._fresh(self._word),
             "P": self._fresh(lambda: f"{r.randint(10_000, 99_999):,}"),
             "Y": self._fresh(lambda: str(r.randint(1650, 1990))),
             "F": self._fresh(lambda: f"{r.choice(_FIRST)} {self._word()}")}
        facts = {k: (qs[k].format(**v) + " " + _HINT[k], v[k]) for k in qs}
        return v["N"], [s1.format(**v), s2.format(**v)], facts

    def filler(self, name: str) -> str:
        r = self.rng
        return r.choice(_FILL).format(It=r.choice((name, "It")), N=name, s=r.choice(_SEASONS),
                                      a=r.choice(_ADJ), b=r.choice(_ADJ), t=r.choice(_THING), u=r.choice(_THING))

    def docs(self) -> Iterator[str]:
        """Endless private text: whole short documents, blank-line separated."""
        while True:
            name, facts, _ = self.doc()
            yield " ".join(facts + [self.filler(name) for _ in range(self.rng.randint(0, 3))]) + "\n\n"


def _exact(tok: Tokenizer, n: int, lead: str, chunks: Iterator[str]) -> list[int]:
    """Exactly n ids: grow text by chunks until it encodes to >= n, drop trailing words while still >= n,
    then cut the surplus ids (a partial last word at most)."""
    text, approx = lead, len(tok.encode(lead))
    ids = tok.encode(text)
    while len(ids) < n:
        while approx < n:                   # per-chunk counts: cheap, close to the whole-text count
            chunk = next(chunks)
            text, approx = text + chunk, approx + len(tok.encode(chunk))
        ids = tok.encode(text)
        approx = len(ids)
    while " " in text.rstrip()[len(lead):]:
        shorter = text.rstrip().rsplit(" ", 1)[0]
        cut = tok.encode(shorter)
        if len(cut) < n:
            break
        text, ids = shorter, cut
    return ids[:n]


def _leader(tokenizer: Tokenizer, gen: "_Text", npre: int, sizes: Sequence[int]
            ) -> tuple[list[int], list[Segment], list[dict[str, tuple[str, str]]]]:
    """The leader's preamble and its segments back to back after it (each one document with at least one whole
    fact sentence), with each segment's answerable facts: shared by both workload shapes."""
    preamble = _exact(tokenizer, npre, "Reference notes:\n\n", gen.docs()) if npre else []
    segments, facts, start = [], [], npre
    for n in sizes:
        name, sents, qa = gen.doc()
        more = (" " + gen.filler(name) for _ in itertools.count())
        ids = _exact(tokenizer, n, "\n\n", itertools.chain([" ".join(sents)], more))
        text = tokenizer.decode(ids)
        kept = {k: v for k, v in qa.items() if (sents[0] if k in "PR" else sents[1]) in text}
        if not kept:
            raise WorkloadError(f"a {n}-token segment is too short to hold one complete fact sentence")
        segments.append(Segment(name, tuple(ids), text, start))
        facts.append(kept)
        start += n
    return preamble, segments, facts


def build(tokenizer: Tokenizer, seed: int, spec: WorkloadSpec = WorkloadSpec()) -> Workload:
    """The leader, its segments and spec.children children, all a function of (tokenizer, seed, spec)."""
    spec.validate()
    rng, pre, suf = random.Random(seed), getattr(tokenizer, "prefix_ids", ()), getattr(tokenizer, "suffix_ids", ())
    gen, nseg = _Text(rng), len(spec.segment_tokens)
    preamble, segments, facts = _leader(tokenizer, gen, spec.leader_preamble_tokens, spec.segment_tokens)
    perms = [p for p in itertools.permutations(range(nseg)) if p != tuple(range(nseg))] or [tuple(range(nseg))]
    rng.shuffle(perms)
    asks, seen = rng.sample(range(nseg), nseg), [set() for _ in range(nseg)]
    children = []
    for c in range(spec.children):
        order, target = perms[c % len(perms)], asks[c % nseg]
        slot = rng.choice(sorted(facts[target]))
        question, answer = facts[target][slot]
        q_ids = tokenizer.encode("\n\nQuestion: " + question)
        budget = spec.prompt_tokens - len(pre) - len(suf) - len(q_ids) - sum(spec.segment_tokens)
        if budget < nseg + 1:
            raise WorkloadError(f"child {c}: {spec.prompt_tokens} tokens leave {budget} for {nseg + 1} private gaps "
                                f"after segments {sum(spec.segment_tokens)}, template {len(pre) + len(suf)} "
                                f"and question {len(q_ids)}")
        for _ in range(1000):   # different gap lengths until no segment start repeats the leader or a sibling
            cuts = sorted(rng.sample(range(1, budget), nseg))
            gaps = [hi - lo for lo, hi in zip([0, *cuts], [*cuts, budget])]
            starts, pos = {}, len(pre) + gaps[0]
            for s, g in zip(order, gaps[1:]):
                starts[s], pos = pos, pos + spec.segment_tokens[s] + g
            if all(starts[s] != segments[s].leader_start and starts[s] not in seen[s] for s in starts):
                break
        else:
            raise WorkloadError(f"child {c}: found no segment positions distinct from the leader and siblings")
        body = list(pre) + _exact(tokenizer, gaps[0], rng.choice(_INTRO) + "\n\n", gen.docs())
        for s, g in zip(order, gaps[1:]):
            seen[s].add(starts[s])
            body += list(segments[s].ids) + _exact(tokenizer, g, "\n\n", gen.docs())
        ids = tuple(body + q_ids + list(suf))
        placements = tuple(Placement(s, starts[s], spec.segment_tokens[s]) for s in order)
        if len(ids) != spec.prompt_tokens or any(ids[p.start:p.end] != segments[p.segment].ids for p in placements):
            raise WorkloadError(f"child {c}: internal accounting error (length {len(ids)})")
        children.append(Child(chr(ord("A") + c) if c < 26 else f"C{c}", ids, placements, question, answer, target))
    return Workload(spec, seed, tuple(preamble) + tuple(i for s in segments for i in s.ids),
                    tuple(segments), tuple(children))


@dataclass(frozen=True)
class RagSpec:
    """A retrieval-augmented prompt: `chunks` retrieved documents of `chunk_tokens` each, back to back after the
    chat template's opening, then a short private tail (an instruction and the question) to exactly
    `prompt_tokens`. The leader saves each chunk once; every child holds all of them, in an order of its own."""

    chunks: int = 8
    chunk_tokens: int = 64
    prompt_tokens: int = 568         # SmolLM2: 30 template tokens, questions of 16-25, the rest a private tail
    children: int = 32
    block_size: int = 16
    leader_preamble_tokens: int = 16
    min_restorable: float = 0.9        # the RAG shape: at least this fraction of every prompt is restored chunks

    @property
    def segment_tokens(self) -> tuple[int, ...]:
        return (self.chunk_tokens,) * self.chunks

    def validate(self) -> None:
        b = self.block_size
        if b < 1 or self.children < 1 or self.chunks < 2:
            raise WorkloadError(f"need block_size >= 1, children >= 1 and at least 2 chunks (got {self})")
        if self.chunk_tokens <= 0 or self.chunk_tokens % b or self.leader_preamble_tokens < 0 \
                or self.leader_preamble_tokens % b:
            raise WorkloadError(f"chunk tokens {self.chunk_tokens} and leader preamble {self.leader_preamble_tokens} "
                                f"must be positive multiples of block_size {b} (preamble may be 0)")
        if math.factorial(self.chunks) - 1 < self.children:
            raise WorkloadError(f"{self.chunks} chunks have {math.factorial(self.chunks) - 1} orders other than the "
                                f"leader's: too few for {self.children} children of distinct orders")
        restorable = self.chunks * self.chunk_tokens / self.prompt_tokens
        if not restorable >= self.min_restorable or self.chunks * self.chunk_tokens >= self.prompt_tokens:
            raise WorkloadError(f"{self.chunks} x {self.chunk_tokens} chunk tokens in a {self.prompt_tokens}-token "
                                f"prompt: {restorable:.3f} restorable, the RAG shape needs >= {self.min_restorable} "
                                f"and room for a private question")


_TAIL = "\n\nUse the notes above to answer. "


def build_rag(tokenizer: Tokenizer, seed: int, spec: RagSpec = RagSpec()) -> Workload:
    """The leader, its chunks and spec.children RAG children, all a function of (tokenizer, seed, spec).

    Each child: template opening, every chunk in an order no sibling and not the leader has (so every chunk sits
    at other positions than where it was saved, and its keys are rotated on restore), then the private tail and a
    question about one chunk's fact. Workload/Child/Placement are the write-up workload's types."""
    spec.validate()
    rng, pre, suf = random.Random(seed), getattr(tokenizer, "prefix_ids", ()), getattr(tokenizer, "suffix_ids", ())
    gen, n, size = _Text(rng), spec.chunks, spec.chunk_tokens
    preamble, segments, facts = _leader(tokenizer, gen, spec.leader_preamble_tokens, spec.segment_tokens)
    asks = rng.sample(range(n), n)
    used: set[tuple[int, ...]] = {tuple(range(n))}
    children = []
    for c in range(spec.children):
        for _ in range(10000):   # an order of its own, with no chunk where the leader saved it
            order = tuple(rng.sample(range(n), n))
            starts = {s: len(pre) + j * size for j, s in enumerate(order)}
            if order not in used and all(starts[s] != segments[s].leader_start for s in starts):
                break
        else:
            raise WorkloadError(f"child {c}: found no chunk order distinct from the leader's and its siblings'")
        used.add(order)
        target = asks[c % n]
        question, answer = facts[target][rng.choice(sorted(facts[target]))]
        q_ids = tokenizer.encode("\n\nQuestion: " + question)
        gap = spec.prompt_tokens - len(pre) - len(suf) - len(q_ids) - n * size
        if gap < 0:
            raise WorkloadError(f"child {c}: {spec.prompt_tokens} tokens leave {gap} for the private tail after "
                                f"{n} x {size} chunk tokens, template {len(pre) + len(suf)} and question {len(q_ids)}")
        tail = _exact(tokenizer, gap, _TAIL, gen.docs()) if gap else []
        body = list(pre) + [i for s in order for i in segments[s].ids] + tail
        ids = tuple(body + q_ids + list(suf))
        placements = tuple(Placement(s, starts[s], size) for s in order)
        if len(ids) != spec.prompt_tokens or any(ids[p.start:p.end] != segments[p.segment].ids for p in placements):
            raise WorkloadError(f"child {c}: internal accounting error (length {len(ids)})")
        children.append(Child(chr(ord("A") + c) if c < 26 else f"C{c}", ids, placements, question, answer, target))
    return Workload(spec, seed, tuple(preamble) + tuple(i for s in segments for i in s.ids), tuple(segments),
                    tuple(children))


def _norm(s: str) -> str:
    s = re.sub(r"(?<=\d)[,\u202f\u00a0 _'](?=\d{3}\b)", "", s.casefold())   # thousands separators
    return " ".join(s.split())


def answer_matches(generated_text: str, answer: str) -> bool:
    """Does the generated text contain the answer (case, whitespace and thousands separators normalized)?
    The match must not sit inside a longer word or number: "148213" does not contain "48,213"."""
    a = _norm(answer)
    return bool(a) and re.search(rf"(?<![0-9a-z]){re.escape(a)}(?![0-9a-z])", _norm(generated_text)) is not None
