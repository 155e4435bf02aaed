"""Record kinds beyond conversations (issue 32, item 2): pretraining text (JSON lines, JSON, parquet,
.txt), Alpaca, image-caption pairs and COCO captions files; recognised by their fields or set by
data.record_kind; read alike by the in-memory, Arrow and streaming readers; documents packed one
segment each, every real token a loss token, long ones cut into row-sized pieces."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from loongforge.config.schema import DataConfig, ModelConfig
from loongforge.data.arrow_samples import ArrowSamples
from loongforge.data.conversations import FileSamples
from loongforge.data.measure import MeasuredSample, SampleMeasurer
from loongforge.data.pipeline import DataPipeline, RejectLog, RowStream
from loongforge.data.record_kinds import RecordError, RecordReading, record_kind
from loongforge.data.samples import ConversationSample, Reject, TextSample
from loongforge.data.streaming import StreamingSamples
from loongforge.data.template import Turn
from tests.data.conftest import COCO_IMAGES, LLAMAFACTORY, SHARED_DATA, require

MODEL = ModelConfig(family="qwen2_5_vl")  # Qwen2.5-VL: <|endoftext|> ends documents
ENDOFTEXT = 151643


def _measurer(tokenizer, seq_len=4096, **data):
    return SampleMeasurer(tokenizer, DataConfig(seq_len=seq_len, **data), MODEL)


def _all(source):
    return [source.get(i) for i in range(len(source))]


def test_kind_is_set_or_recognised_by_fields_in_documented_order():
    auto = RecordReading()
    assert record_kind({"messages": [], "text": "x", "instruction": "i", "output": "o"}, auto) == "conversation"
    assert record_kind({"instruction": "i", "output": "o", "text": "x"}, auto) == "alpaca"
    assert record_kind({"image": "a.jpg", "caption": "c", "text": "x"}, auto) == "caption"
    assert record_kind({"text": "x"}, auto) == "text"
    assert record_kind({"instruction": "i", "text": "x"}, auto) == "text"  # no output: not alpaca
    assert record_kind({"messages": []}, RecordReading(kind="text")) == "text"
    with pytest.raises(RecordError, match="no fields of a known record kind.*it has: body, title"):
        record_kind({"title": "t", "body": "b"}, auto)
    with pytest.raises(ValueError, match="record kind 'pretrain' is not one of"):
        RecordReading(kind="pretrain")


MALFORMED = [  # (record, reason)
    ({"text": 3}, "malformed_json"),
    ({"text": "   "}, "empty_answer"),
    ({"instruction": 5, "output": "x"}, "malformed_json"),
    ({"instruction": "q", "output": ""}, "empty_answer"),
    ({"instruction": "q", "output": "a", "history": [["only a question"]]}, "malformed_json"),
    ({"caption": "a dog"}, "malformed_json"),  # no image
    ({"image": "a.jpg", "caption": ""}, "empty_answer"),
    ({"title": "no known fields"}, "malformed_json"),
]
GOOD = [
    {"text": "A document about cats."},
    {"instruction": "Add.", "input": "2 + 2", "output": "4", "system": "Be brief.",
     "history": [["Hi", "Hello."]]},
    {"image": "a.jpg", "caption": "A cat on a mat."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]},
]


def test_each_kind_parses_and_malformed_records_are_counted_rejects_by_every_reader(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD + [r for r, _ in MALFORMED]))
    samples = _all(FileSamples([str(path)]))
    text, alpaca, caption, chat = samples[:4]
    assert isinstance(text, TextSample) and text.text == "A document about cats." and text.line == 1
    assert alpaca.turns == [Turn("system", "Be brief."), Turn("user", "Hi"), Turn("assistant", "Hello."),
                            Turn("user", "Add.\n2 + 2"), Turn("assistant", "4")]
    assert caption.turns == [Turn("user", "<image>"), Turn("assistant", "A cat on a mat.")]
    assert caption.images == [str(tmp_path / "a.jpg")]
    assert isinstance(chat, ConversationSample)
    assert [(s.line, s.reason) for s in samples[4:]] == [(5 + i, reason) for i, (_, reason) in enumerate(MALFORMED)]
    # The Arrow copy and the stream read the same samples and rejects.
    assert _all(ArrowSamples([str(path)], str(tmp_path / "cache"))) == samples
    streamed = StreamingSamples([str(path)], window=64, shuffle=False, seed=0)
    assert [streamed.get(0, p) for p in range(len(samples))] == samples
    # A fixed kind reads every record as that kind: conversations are then malformed text.
    as_text = _all(FileSamples([str(path)], RecordReading(kind="text")))
    assert isinstance(as_text[0], TextSample) and as_text[3].reason == "malformed_json"
    prompted = FileSamples([str(path)], RecordReading(caption_prompt="Describe it. ")).get(2)
    assert prompted.turns[0] == Turn("user", "<image>Describe it. ")


def test_text_in_json_parquet_and_txt_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["First document.", "Second one,\ttabbed.", "Third."]
    (tmp_path / "a.json").write_text(json.dumps([{"text": d} for d in docs], indent=1))
    pq.write_table(pa.table({"text": docs}), tmp_path / "b.parquet")
    # .txt: one document per non-empty line (blank lines separate nothing, they are skipped).
    (tmp_path / "c.txt").write_text(f"{docs[0]}\n\n{docs[1]}\r\n{docs[2]}")
    # A folder gives its JSON and parquet files, not its .txt files (a README would become data).
    in_folder = {s.file for s in _all(FileSamples([str(tmp_path)]))}
    assert in_folder == {str(tmp_path / "a.json"), str(tmp_path / "b.parquet")}
    for name, lines in (("a.json", [2, 5, 8]), ("b.parquet", [1, 2, 3]), ("c.txt", [1, 3, 4])):
        files = [str(tmp_path / name)]
        read = _all(FileSamples(files))
        assert [(s.text, s.line) for s in read] == list(zip(docs, lines)), name
        assert _all(ArrowSamples(files, str(tmp_path / "cache"))) == read, name
        streamed = StreamingSamples(files, window=2, shuffle=False, seed=0)
        assert [streamed.get(0, p) for p in range(3)] == read and streamed.get(0, 3) is None, name
    # A .txt line is a document whatever data.record_kind says.
    assert isinstance(FileSamples([str(tmp_path / "c.txt")], RecordReading(kind="alpaca")).get(0), TextSample)
    wiki = FileSamples([str(require(LLAMAFACTORY / "wiki_demo.txt"))])
    assert len(wiki) == 30 and wiki.get(0).text.startswith("Anarchism is a political philosophy")


def test_document_is_its_tokens_and_end_of_document_all_loss_tokens(tokenizer, small_tokenizers):
    text = "Plain text. It may even mention <|im_start|> or <|image_pad|> as words."
    measured = _measurer(tokenizer).measure(TextSample("t:1", "t", 1, text))
    assert measured.input_ids[-1] == ENDOFTEXT and measured.is_answer.all() and measured.document
    assert tokenizer.decode(measured.input_ids[:-1]) == text  # special-token names stay plain text
    assert not np.isin(measured.input_ids[:-1], [151644, 151655]).any()
    # The small test vocabularies hold their end-of-document tokens too.
    for spec, (tok, model_cfg, end, start) in small_tokenizers.items():
        data_cfg = DataConfig(seq_len=4096, tokenizer=spec)
        ids = SampleMeasurer(tok, data_cfg, model_cfg).measure(TextSample("t:1", "t", 1, "Hi.")).input_ids
        assert tok.convert_ids_to_tokens([int(ids[-1])]) == [end], spec
        assert (tok.convert_ids_to_tokens([int(ids[0])]) == [start]) if start else ids[0] != ids[-1], spec


@pytest.fixture(scope="module")
def small_tokenizers():
    from loongforge.config.loader import load_run_config
    from loongforge.data.tokenizer import load_tokenizer

    runs = {"qwen-small": ("qwen2.5vl-tiny-small-vocab", "<|endoftext|>", None),
            "llama3-small": ("llama-tiny-small-vocab", "<|end_of_text|>", "<|begin_of_text|>")}
    return {spec: (load_tokenizer(spec), load_run_config(preset).model, end, start)
            for spec, (preset, end, start) in runs.items()}


def _c4_file(tmp_path, count):
    lines = require(LLAMAFACTORY / "c4_demo.jsonl").read_text().splitlines()[:count]
    path = tmp_path / "c4.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_packed_pretraining_row_has_one_segment_per_document(tokenizer, tmp_path):
    cfg = DataConfig(source="files", paths=[str(_c4_file(tmp_path, 12))], seq_len=2048, num_workers=0,
                     shuffle=False, cache_dir=str(tmp_path / "cache"))
    pipeline = DataPipeline(cfg, MODEL, global_batch_size=1, dp_rank=0, dp_size=1, pad_to_multiple=64,
                            tokenizer=tokenizer)
    mb = pipeline.next_step()[0]
    lengths, cu = mb["sample_lengths"], mb["cu_seqlens"].tolist()
    assert len(lengths) >= 3, lengths  # several documents share the row
    assert cu[:len(lengths) + 1] == np.cumsum([0, *lengths]).tolist()  # a boundary at every document
    ids, labels, loss = mb["input_ids"][0], mb["labels"][0], mb["loss_mask"][0]
    real = sum(lengths)
    ends = [c - 1 for c in cu[1:len(lengths) + 1]]
    assert (ids[ends] == ENDOFTEXT).all()  # each document closes with <|endoftext|>
    expected_loss = torch.ones(len(ids))
    expected_loss[ends] = 0  # a document's last token has nothing after it to predict
    expected_loss[real:] = 0  # padding
    assert torch.equal(loss, expected_loss)
    inside = torch.ones(len(ids), dtype=torch.bool)
    inside[ends] = False
    inside[real:] = False
    assert torch.equal(labels[:-1][inside[:-1]], ids[1:][inside[:-1]])  # next token of the same document
    assert (labels[ends] == 0).all()
    # The model's attention takes the same segments: tokens of document 2 do not see document 1.
    _assert_attention_stays_in_segments(mb["cu_seqlens"])


def _assert_attention_stays_in_segments(cu_seqlens):
    from megatron.core.packed_seq_params import PackedSeqParams

    from loongforge.models.layers.attention import SDPACoreAttention

    attention = object.__new__(SDPACoreAttention)  # the packed path needs no config beyond these
    torch.nn.Module.__init__(attention)
    attention.softmax_scale, attention.dropout_p, attention.attn_mask_type = 0.125, 0.0, None
    attention.cp_group = None  # no context parallelism
    tokens = int(cu_seqlens[-1])
    q, k, v = (torch.randn(tokens, 2, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens)
    from megatron.core.transformer.enums import AttnMaskType

    out = attention.forward(q, k, v, None, AttnMaskType.causal, packed_seq_params=params)
    first_end = int(cu_seqlens[1])
    k2, v2 = k.clone(), v.clone()
    k2[:first_end] += 1.0  # change document 1 only
    v2[:first_end] += 1.0
    again = attention.forward(q, k2, v2, None, AttnMaskType.causal, packed_seq_params=params)
    assert torch.equal(out[first_end:], again[first_end:])
    assert not torch.equal(out[:first_end], again[:first_end])


def _doc_stream(tokenizer, path, seq_len, cache):
    cfg = DataConfig(seq_len=seq_len)
    return RowStream(ArrowSamples([str(path)], cache), SampleMeasurer(tokenizer, cfg, MODEL), seq_len=seq_len,
                     lookahead=4, shuffle=False, seed=0, rejects=RejectLog(None))


def test_long_document_is_cut_into_row_sized_pieces_and_resumes_inside_it(tokenizer, tmp_path):
    wiki = require(LLAMAFACTORY / "wiki_demo.txt").read_text().splitlines()
    path = tmp_path / "wiki.txt"
    path.write_text("\n".join(wiki[:2]) + "\n")
    whole = [_measurer(tokenizer, seq_len=1 << 20).measure(TextSample("w", "w", 1, doc)) for doc in wiki[:2]]
    seq_len = 1024
    stream = _doc_stream(tokenizer, path, seq_len, str(tmp_path / "cache"))
    items, states = [], []
    while len(items) < sum(-(-w.length // seq_len) for w in whole):
        states.append(stream.state_dict())
        items += stream.next_row()
    assert all(item.length <= seq_len for item in items)
    by_doc = {}
    for item in items:
        by_doc.setdefault(item.key[:2], []).append(item)
    for key, expected in zip(sorted(by_doc), whole):
        pieces = sorted(by_doc[key], key=lambda item: item.key[2])
        assert [item.key[2] for item in pieces] == list(range(len(pieces))) and len(pieces) > 1
        joined = np.concatenate([p.payload.input_ids for p in pieces])
        assert np.array_equal(joined, expected.input_ids)  # no token lost or doubled
        assert all(p.length == seq_len for p in pieces[:-1])
    # Resuming inside a cut document gives the same rows as going on.
    middle = next(i for i, s in enumerate(states) if s["pieces"] or any(len(k) == 3 for k in s["buffer"]))
    resumed = _doc_stream(tokenizer, path, seq_len, str(tmp_path / "cache"))
    resumed.load_state_dict(json.loads(json.dumps(states[middle])))
    going_on = _doc_stream(tokenizer, path, seq_len, str(tmp_path / "cache"))
    going_on.load_state_dict(states[0])
    for _ in range(middle):
        going_on.next_row()
    for _ in range(3):
        assert [i.key for i in resumed.next_row()] == [i.key for i in going_on.next_row()]


def _as_conversation(record):
    history = [m for q, a in record.get("history", []) for m in ({"role": "user", "content": q},
                                                                 {"role": "assistant", "content": a})]
    system = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    question = record["instruction"] + (f"\n{record['input']}" if record.get("input") else "")
    return {"messages": system + history + [{"role": "user", "content": question},
                                            {"role": "assistant", "content": record["output"]}]}


def test_alpaca_renders_like_the_same_conversation(tokenizer, tmp_path):
    demo = json.loads(require(LLAMAFACTORY / "alpaca_en_demo.json").read_text())
    with_input = next(r for r in demo if r["input"])
    records = [demo[0], with_input, GOOD[1]]
    path = tmp_path / "alpaca.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" + json.dumps(_as_conversation(r)) + "\n" for r in records))
    measurer = _measurer(tokenizer)
    samples = _all(FileSamples([str(path)]))
    for alpaca, chat in zip(samples[::2], samples[1::2]):
        a, c = measurer.measure(alpaca), measurer.measure(chat)
        assert np.array_equal(a.input_ids, c.input_ids) and np.array_equal(a.is_answer, c.is_answer)
        assert 0 < a.is_answer.sum() < a.length


def test_caption_pairs_and_coco_file_train_on_the_caption_only(tokenizer, tmp_path):
    coco = require(SHARED_DATA / "coco2017" / "captions_val2017.json")
    samples = FileSamples([str(coco)])
    present = {p.name for p in require(COCO_IMAGES).glob("*.jpg")}
    annotations = json.loads(coco.read_text())["annotations"]
    assert len(samples) == len(annotations) == 25014
    measurer = _measurer(tokenizer, max_pixels=50176)
    rejects = RejectLog(tmp_path / "rejects.jsonl")
    trained, read = [], _all(samples)
    for index, sample in enumerate(read):
        measured = sample if isinstance(sample, Reject) else measurer.measure(sample)
        if isinstance(measured, Reject):
            rejects.record(measured)
        else:
            trained.append((index, measured))
    wanted = sum(1 for s in read if s.images[0].split("/")[-1] in present)
    assert len(trained) == wanted and wanted >= 50 * 5  # every COCO image has 5+ captions
    assert rejects.counts() == {"missing_image": len(samples) - wanted}
    assert len((tmp_path / "rejects.jsonl").read_text().splitlines()) == len(samples) - wanted
    index, measured = trained[0]
    answer = tokenizer.decode(measured.input_ids[measured.is_answer])
    assert answer == annotations[index]["caption"] + "<|im_end|>"  # the caption (and its end of turn) only
    # A caption record with a prompt: the prompt is a user turn, not trained.
    pair = tmp_path / "pairs.jsonl"
    image = sorted(present)[0]
    pair.write_text(json.dumps({"image": str(COCO_IMAGES / image), "caption": "Something."}) + "\n")
    prompted = DataConfig(max_pixels=50176, caption_prompt="Describe the image.")
    sample = FileSamples([str(pair)], RecordReading(caption_prompt=prompted.caption_prompt)).get(0)
    measured = SampleMeasurer(tokenizer, prompted, MODEL).measure(sample)
    assert isinstance(measured, MeasuredSample)
    assert tokenizer.decode(measured.input_ids[measured.is_answer]) == "Something.<|im_end|>"
    assert "Describe the image." in tokenizer.decode(measured.input_ids)
    assert Counter(measured.input_ids.tolist())[MODEL.tokens.image_token_id] == measured.image_grids[0][1] * \
        measured.image_grids[0][2] // 4


def test_streamed_long_document_is_cut_and_resumes_inside_it(tokenizer, tmp_path):
    wiki = require(LLAMAFACTORY / "wiki_demo.txt").read_text().splitlines()
    path = tmp_path / "wiki.txt"
    path.write_text("\n".join(wiki[:2]) + "\n")
    cfg = DataConfig(source="files", paths=[str(path)], seq_len=1024, num_workers=0, streaming=True,
                     shuffle_window=2)

    def pipeline():
        return DataPipeline(cfg, MODEL, global_batch_size=1, dp_rank=0, dp_size=1, pad_to_multiple=64,
                            tokenizer=tokenizer, lookahead=2)

    going_on = pipeline()
    first = [going_on.next_step()[0] for _ in range(3)]
    doc = first[0]["sample_ids"][0].split("#")[0]  # the window is shuffled: either article first
    assert [mb["sample_ids"] for mb in first] == [[f"{doc}#{piece}"] for piece in range(3)]
    assert [mb["sample_lengths"] for mb in first] == [[1024]] * 3
    state = json.loads(json.dumps(going_on.state_dict()))
    assert state["stream"]["pieces"], state  # saved inside the cut document
    resumed = pipeline()
    resumed.load_state_dict(state)
    for _ in range(4):
        a, b = going_on.next_step()[0], resumed.next_step()[0]
        assert a["sample_ids"] == b["sample_ids"] and torch.equal(a["input_ids"], b["input_ids"])


def test_resume_at_another_dp_size_inside_cut_documents_trains_every_piece_once(tokenizer, tmp_path):
    wiki = require(LLAMAFACTORY / "wiki_demo.txt").read_text().splitlines()[:4]
    c4 = require(LLAMAFACTORY / "c4_demo.jsonl").read_text().splitlines()[:8]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in wiki) + "\n".join(c4) + "\n")
    samples, seq_len = ArrowSamples([str(path)], str(tmp_path / "cache")), 1024
    measurer = _measurer(tokenizer, seq_len=seq_len)

    def shard(index, count):
        return RowStream(samples, measurer, seq_len=seq_len, lookahead=4, shuffle=True, seed=3,
                         rejects=RejectLog(None), shard=(index, count))

    def pieces_of(index):
        length = measurer.measure(samples.get(index)).length
        return [None] if length <= seq_len else list(range(-(-length // seq_len)))

    order = shard(0, 1).epoch_order(0)
    expected = Counter((0, position, piece) for position in range(len(samples))
                       for piece in pieces_of(int(order[position])))
    trained = Counter()

    def train(stream, rows):
        for _ in range(rows):
            for item in stream.next_row():
                if item.key[0] == 0:
                    trained[(*item.key, None) if len(item.key) == 2 else tuple(item.key)] += 1

    old = [shard(0, 2), shard(1, 2)]
    for stream in old:
        train(stream, 7)
    states = [json.loads(json.dumps(stream.state_dict())) for stream in old]
    assert any(s["pieces"] or any(len(k) == 3 for k in s["buffer"]) for s in states)  # inside a document
    for index in range(3):
        new = shard(index, 3)
        new.load_state_dict(new.redealt(states))
        train(new, 40)
    assert trained == expected  # every piece of every document of epoch 0 once, none lost or doubled
