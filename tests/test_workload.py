"""The equivalence stage's workload: exact lengths, placements, determinism and answerable questions."""

import pytest

from kmesh.errors import KMeshError
from kmesh.harness.workload import (ByteTokenizer, HFTokenizer, RagSpec, Workload, WorkloadError, WorkloadSpec,
                                    answer_matches, build, build_rag)
from smollm2_model import converted

SEED = 20261130


def _smollm2_tokenizer():
    transformers = pytest.importorskip("transformers")
    return HFTokenizer(transformers.AutoTokenizer.from_pretrained(converted(), local_files_only=True))


@pytest.fixture(scope="module", params=["byte", "smollm2"])
def tok(request):
    return ByteTokenizer(151936, offset=3) if request.param == "byte" else _smollm2_tokenizer()


@pytest.fixture(scope="module")
def work(tok) -> Workload:
    return build(tok, SEED)


def test_lengths_are_exact(tok, work):
    spec = work.spec
    assert len(work.leader_ids) == 16 + 416 == spec.leader_preamble_tokens + sum(spec.segment_tokens)
    assert [s.tokens for s in work.segments] == [128, 112, 96, 80]
    assert [s.leader_start for s in work.segments] == [16, 144, 256, 352]
    for s in work.segments:
        assert s.leader_start % spec.block_size == 0
        assert work.leader_ids[s.leader_start:s.leader_start + s.tokens] == s.ids
        assert s.text == tok.decode(s.ids)
    assert len(work.children) == 4 and [c.name for c in work.children] == ["A", "B", "C", "D"]
    for c in work.children:
        assert len(c.ids) == 512
        assert len(c.restored_positions()) == 416 and len(c.private_positions()) == 96


def test_smollm2_chat_template_wraps_every_child():
    tok = _smollm2_tokenizer()
    assert tok.chat_template and len(tok.prefix_ids) == 24 and len(tok.suffix_ids) == 6
    full = tok.tok.apply_chat_template([{"role": "user", "content": "hello there"}], add_generation_prompt=True,
                                       tokenize=False)
    assert tok.decode(tok.prefix_ids) + "hello there" + tok.decode(tok.suffix_ids) == full
    for c in build(tok, SEED).children:
        assert c.ids[:24] == tok.prefix_ids and c.ids[-6:] == tok.suffix_ids
        text = tok.decode(c.ids)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert text.endswith(f"Question: {c.question}<|im_end|>\n<|im_start|>assistant\n")


def test_determinism(tok, work):
    again = build(tok, SEED)
    assert again.describe() == work.describe() and again == work
    other = build(tok, SEED + 1)
    assert other.describe()["sha256"] != work.describe()["sha256"]
    assert {s.name for s in other.segments}.isdisjoint(s.name for s in work.segments)
    assert [s.text for s in other.segments] != [s.text for s in work.segments]


def test_placements_cover_exactly_the_restored_positions(tok, work):
    prefix, suffix = len(getattr(tok, "prefix_ids", ())), len(getattr(tok, "suffix_ids", ()))
    for c in work.children:
        assert sorted(p.segment for p in c.placements) == [0, 1, 2, 3]
        covered = [i for p in c.placements for i in range(p.start, p.start + work.segments[p.segment].tokens)]
        assert len(covered) == len(set(covered)) == 416                       # no overlap
        assert sorted(covered) == c.restored_positions()
        assert sorted(covered + c.private_positions()) == list(range(512))
        for seg, start, end in c.segment_slices():
            assert c.ids[start:end] == work.segments[seg].ids
        slices = c.segment_slices()
        assert slices[0][1] >= prefix + 1                                      # private text before the first
        assert all(b[1] > a[2] for a, b in zip(slices, slices[1:]))           # and between segments
        tail = tok.decode(c.ids[slices[-1][2]:len(c.ids) - suffix])
        assert tail.endswith("Question: " + c.question) and len(tail) > len("Question: " + c.question)


def test_positions_differ_between_children_and_from_the_leader(work):
    orders = [tuple(p.segment for p in c.placements) for c in work.children]
    assert len(set(orders)) == 4 and (0, 1, 2, 3) not in orders
    for i, s in enumerate(work.segments):
        starts = [p.start for c in work.children for p in c.placements if p.segment == i]
        assert len(set(starts)) == 4 and s.leader_start not in starts
    gaps = [[p.start for p in c.placements] for c in work.children]
    assert len({tuple(g) for g in gaps}) == 4


def test_answer_lies_in_exactly_the_asked_segment(tok, work):
    assert sorted(c.asks for c in work.children) == [0, 1, 2, 3]              # one question per segment
    for c in work.children:
        texts = [tok.decode(s.ids) for s in work.segments]
        assert [c.answer in t for t in texts] == [i == c.asks for i in range(4)]
        assert work.segments[c.asks].name in c.question
        assert tok.decode(c.ids).count(c.answer) == 1                         # not in private text either
        assert c.question.split("? ")[1] in ("Give only the number.", "Give only the year.", "Give only the name.")
        assert c.answer not in c.question
        assert answer_matches(f"The answer is {c.answer}.", c.answer)


@pytest.mark.parametrize("length,segments", [(4096, (1024, 896, 768, 640)), (16384, (4096, 3584, 3072, 2560))])
def test_scaled_specs_build(tok, length, segments):
    spec = WorkloadSpec().scaled(length)
    assert spec.segment_tokens == segments and spec.prompt_tokens == length
    w = build(tok, SEED, spec)
    assert len(w.leader_ids) == 16 + sum(segments)
    for c in w.children:
        assert len(c.ids) == length and len(c.restored_positions()) == sum(segments)
        assert all(c.ids[a:b] == w.segments[s].ids for s, a, b in c.segment_slices())


@pytest.mark.parametrize("spec,message", [
    (WorkloadSpec(segment_tokens=(128, 112, 96, 81)), "multiples of block_size"),
    (WorkloadSpec(leader_preamble_tokens=10), "multiples of block_size"),
    (WorkloadSpec(children=0), "children >= 1"),
    (WorkloadSpec(prompt_tokens=420), "exceed prompt_tokens"),
    (WorkloadSpec(prompt_tokens=430), "private gaps"),         # passes the static check, not the question's
    (WorkloadSpec(segment_tokens=(16, 16, 16, 16)), "too short"),
])
def test_bad_specs_raise(spec, message):
    with pytest.raises(WorkloadError, match=message) as err:
        build(ByteTokenizer(512), SEED, spec)
    assert isinstance(err.value, KMeshError)


# --- the RAG shape ------------------------------------------------------------------------------------------

BYTE_RAG = RagSpec(chunk_tokens=192, prompt_tokens=1700)     # bytes: a fact sentence needs ~70 of them


@pytest.fixture(scope="module")
def rag(tok) -> Workload:
    return build_rag(tok, SEED, RagSpec() if isinstance(tok, HFTokenizer) else BYTE_RAG)


def test_rag_children_hold_every_chunk_in_orders_of_their_own(tok, rag):
    spec = rag.spec
    n, size = spec.chunks, spec.chunk_tokens
    assert len(rag.children) == spec.children == 32 and len(rag.segments) == n
    assert rag.leader_ids == tuple(rag.leader_ids[:16]) + tuple(i for s in rag.segments for i in s.ids)
    assert [s.leader_start for s in rag.segments] == [16 + i * size for i in range(n)]
    pre = len(getattr(tok, "prefix_ids", ()))
    orders = []
    for c in rag.children:
        assert len(c.ids) == spec.prompt_tokens
        assert len(c.restored_positions()) == n * size and len(c.restored_positions()) / len(c.ids) >= 0.9
        assert [p.start for p in c.placements] == [pre + j * size for j in range(n)]      # back to back
        assert all(c.ids[p.start:p.end] == rag.segments[p.segment].ids for p in c.placements)
        assert all(p.start != rag.segments[p.segment].leader_start for p in c.placements)  # every key rotated
        orders.append(tuple(p.segment for p in c.placements))
    assert len(set(orders)) == 32 and tuple(range(n)) not in orders
    assert set(c.asks for c in rag.children) == set(range(n))                        # every chunk asked about
    for c in rag.children:
        texts = [tok.decode(s.ids) for s in rag.segments]
        assert c.answer in texts[c.asks] and rag.segments[c.asks].name in c.question
        assert tok.decode(c.ids).count(c.answer) == 1
    again = build_rag(tok, SEED, spec)
    assert again.sha256() == rag.sha256() and build_rag(tok, SEED + 1, spec).sha256() != rag.sha256()


@pytest.mark.parametrize("spec,message", [
    (RagSpec(chunks=1), "at least 2 chunks"),
    (RagSpec(chunk_tokens=60), "multiples of block_size"),
    (RagSpec(chunks=3, children=6), "too few for 6 children"),
    (RagSpec(prompt_tokens=640), "needs >= 0.9"),
    (RagSpec(prompt_tokens=512), "room for a private question"),
    (RagSpec(chunk_tokens=192, prompt_tokens=1540), "private tail"),     # the static check passes, not the question
    (RagSpec(chunk_tokens=16, prompt_tokens=140), "too short"),
])
def test_bad_rag_specs_raise(spec, message):
    with pytest.raises(WorkloadError, match=message):
        build_rag(ByteTokenizer(512), SEED, spec)


def test_byte_tokenizer():
    t = ByteTokenizer(300, offset=44)
    assert t.encode("Aé") == [44 + 65, 44 + 0xC3, 44 + 0xA9] and t.decode(t.encode("Aé")) == "Aé"
    with pytest.raises(ValueError, match="vocab_size"):
        ByteTokenizer(299, offset=44)
    ids = [i for c in build(t, SEED).children for i in c.ids]
    assert min(ids) >= 44 and max(ids) < 300


class _FakeHF:
    """A character tokenizer with an optional chat template, to exercise HFTokenizer's fallback."""

    def __init__(self, template=None, full_extra=()):
        self.template, self.full_extra = template, list(full_extra)

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        return [ord(ch) for ch in text]

    def decode(self, ids, **kw):
        return "".join(map(chr, ids))

    def apply_chat_template(self, msgs, add_generation_prompt, tokenize):
        if self.template is None:
            raise ValueError("no chat template")
        text = self.template.format(msgs[0]["content"])
        return text if not tokenize else {"input_ids": self.encode(text, False) + self.full_extra}


def test_hf_tokenizer_template_split_and_fallback():
    good = HFTokenizer(_FakeHF("<u>{}</u><a>"))
    assert good.chat_template and good.decode(good.prefix_ids) == "<u>" and good.decode(good.suffix_ids) == "</u><a>"
    c = build(good, SEED).children[0]
    assert good.decode(c.ids).startswith("<u>") and good.decode(c.ids).endswith("</u><a>") and len(c.ids) == 512
    for bad in (HFTokenizer(_FakeHF()), HFTokenizer(_FakeHF("<u>{}</u>", full_extra=[1]))):
        assert not bad.chat_template and bad.prefix_ids == () and bad.suffix_ids == ()


@pytest.mark.parametrize("text,answer,ok", [
    ("The population is 48,213 people.", "48,213", True),
    ("48213", "48,213", True),
    ("It is 48 213.", "48,213", True),
    ("  ilse   ORVATON founded it", "Ilse Orvaton", True),
    ("1742.", "1742", True),
    ("148,213", "48,213", False),
    ("48,2130", "48,213", False),
    ("48,214", "48,213", False),
    ("Ilse Orvatonson", "Ilse Orvaton", False),
    ("Orvaton", "Ilse Orvaton", False),
    ("anything", "", False),
])
def test_answer_matches(text, answer, ok):
    assert answer_matches(text, answer) is ok
