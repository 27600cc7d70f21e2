"""One prompt for training and serving (jobspec/data/chat_render.py): for every assistant turn the
ids training puts before the answer are the ids the model is served, `apply_chat_template(turns
before it, add_generation_prompt=True, tokenize=True)`, and the answer's ids follow them.

Checked with tokenizers built as Llama 3, Qwen2, Gemma and Mistral build theirs (their
tokenizer.json: normalizer, pre-tokenizer, decoder, post-processor, added tokens; their chat
templates, from tokenizer_config.json, shortened) on small vocabularies trained here, with the
shipped tokenizer (jobs/data), and with a GPT-2-style byte-level tokenizer whose pre-tokenizer
splits '\\n\\n' before a word: the whole conversation tokenised at once ends a prompt 'Ċ' 'Ċ' where
the served prompt ends 'ĊĊ', which made a model answer "." to every prompt. Then the data
preparation pass's check of its first records, and the evaluation generation's prompts and the
exported tokenizer on the same records."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers.pre_tokenizers as pre_tokenizers
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, processors, trainers

from jobspec.data import chat_render, prepare as data_prep
from jobspec.data.chat_render import RecordText
from jobspec.tasks.base import IGNORE_INDEX
from jobspec.errors import SpecError
from jobspec.spec.schema import fill_defaults
from tests.conftest import REPO_ROOT

SHIPPED = REPO_ROOT / "jobs" / "data" / "tokenizer"

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if (message['role'] == 'assistant') %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
# Mistral-7B-Instruct-v0.3's, tools left out: the system message goes into the last user turn
MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] %}{%- set loop_messages = messages[1:] %}"
    "{%- else %}{%- set loop_messages = messages %}{%- endif %}"
    "{{- bos_token }}{%- for message in loop_messages %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('roles must alternate user/assistant/user/assistant/...') }}{%- endif %}"
    "{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}"
    "{{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}"
    "{%- else %}{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}"
    "{%- elif message['role'] == 'assistant' %}"
    "{{- ' ' + message['content']|trim + eos_token}}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported') }}"
    "{%- endif %}{%- endfor %}")


def turns(*contents: str, system: str | None = None) -> list[dict]:
    messages = [{"role": "system", "content": system}] if system else []
    for i, content in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": content})
    return messages


CONVERSATIONS = [
    turns("Hi there", "Hello! How can I help?", "What is 12 + 30?", "12 + 30 = 42.",
          "Thanks", "You're welcome."),
    turns("Write code", "```python\nprint(1)\n```", "Explain it", "It prints 1.\n\nThat's all."),
    turns("Say good morning in French", "Bonjour.", "And 'thank you'?", "\"Merci.\"",
          "Numbers?", "3.14159 and 2.71828"),
    turns("List two fruits.", "- apple\n- pear", "And two colours?", "- red\n- blue",
          system="You are terse."),
]
HEADERS = [f"<|start_header_id|>{role}<|end_header_id|>\n\n" for role in ("user", "assistant")]
TEXT = [m["content"] for c in CONVERSATIONS for m in c] + [
    "The quick brown fox jumps over the lazy dog. It is 2024 and the year has 365 days.",
    "assistant user system model", "Hello, world!\n\nA new paragraph:\n- one\n- two\n",
    *HEADERS * 5]   # as a real vocabulary has them: 'ĊĊ' one token where a header ends


def wrapped(tok, template: str, **tokens):
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                        **tokens)
    tokenizer.chat_template = template
    return tokenizer


def byte_level(specials: list[str], split: str | None, normalizer=None, ignore_merges=False):
    """A byte-level BPE as Llama 3 and Qwen2 build theirs: a regex split, then bytes (`split`
    None: GPT-2's ByteLevel with its own regex)."""
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.normalizer = normalizer
    bytes_only = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    regex = pre_tokenizers.Split(Regex(split), behavior="isolated") if split else None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if regex is None else \
        pre_tokenizers.Sequence([regex, bytes_only])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(TEXT, trainer)
    return tok


def sentencepiece_like(specials: list[str], normalizer, pre_tokenizer, decoder, bos: str):
    """A BPE with byte fallback as Gemma and Mistral convert theirs from SentencePiece, its
    merges learnt within words ('▁' in front) and runs of newlines, as SentencePiece learns
    them."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"▁?[^▁\n\d]+|\n+|\d"), behavior="isolated")
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                      show_progress=False))
    tok.normalizer, tok.pre_tokenizer, tok.decoder = normalizer, pre_tokenizer, decoder
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>"]


def llama3():
    tok = byte_level(LLAMA3_SPECIALS, LLAMA3_SPLIT, ignore_merges=True)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                      special_tokens=[("<|begin_of_text|>", 0)])])
    return wrapped(tok, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def qwen2():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = byte_level(specials, QWEN2_SPLIT, normalizers.NFC())
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return wrapped(tok, QWEN2_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def sentencepiece_decoder(strip: bool):
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    return decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if strip else []))


def gemma():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tok = sentencepiece_like(specials, normalizers.Replace(" ", "▁"),
                             pre_tokenizers.Split(" ", "merged_with_previous"),
                             sentencepiece_decoder(strip=False), "<bos>")
    return wrapped(tok, GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                   unk_token="<unk>")


def mistral(metaspace: bool = False):
    """Mistral v0.3's tokenizer.json (the legacy conversion: the normalizer puts '▁' before every
    text between added tokens), or the non-legacy conversion's Metaspace pre-tokenizer ('▁' only
    at the start of the input)."""
    legacy = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    split = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok = sentencepiece_like(["<unk>", "<s>", "</s>", "[INST]", "[/INST]"],
                             None if metaspace else legacy, split if metaspace else None,
                             sentencepiece_decoder(strip=True), "<s>")
    return wrapped(tok, MISTRAL_TEMPLATE, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def gpt2_style():
    """The shipped tokenizer as it was: GPT-2's ByteLevel regex, which splits '\\n\\n' before a
    word into '\\n' '\\n'."""
    tok = byte_level(LLAMA3_SPECIALS, None)
    return wrapped(tok, LLAMA3_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


def shipped():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(SHIPPED)


FAMILIES = {"llama3": llama3, "qwen2": qwen2, "gemma": gemma, "mistral": mistral,
            "mistral-metaspace": lambda: mistral(metaspace=True), "shipped": shipped}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    return request.param, FAMILIES[request.param]()


def spec_for(train: Path | str = "unused.jsonl", tokenizer: Path | str = SHIPPED, **data) -> dict:
    config = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 512, "vocab_size": 2048}
    return fill_defaults({
        "name": "served", "output_dir": "/tmp/unused",
        "model": {"architecture": "gpt2", "task": "causal-lm", "config": config},
        "data": {"train": str(train), "tokenizer": str(tokenizer), "max_length": 512,
                 "records": "chat", **data},
        "training": {"max_steps": 2, "micro_batch_size": 2,
                     "eval_generate": {"max_new_tokens": 8}}})


def rendered(tokenizer, messages: list, loss_on: str = "answers"):
    """(text, ids, labels) of a conversation as the data preparation pass makes them."""
    spec = spec_for(loss_on=loss_on)
    record_text = RecordText(spec, tokenizer, "chat", tokenizer.chat_template, "train")
    text = record_text({"messages": messages}, "test:1")
    ids, labels = chat_render.encode(tokenizer, [text], loss_on == "all")[0]
    return text, ids.tolist(), labels.tolist()


def served(tokenizer, messages: list) -> list[int]:
    """What transformers prompts a model with: apply_chat_template(tokenize=True)."""
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def answer_turns(messages: list) -> list[int]:
    return [i for i, m in enumerate(messages) if m["role"] == "assistant"]


def answer_start(labels: list, position: int) -> int:
    return next(k for k in range(position, len(labels)) if labels[k] != IGNORE_INDEX)


def answer_end(labels: list, start: int) -> int:
    return next((k for k in range(start, len(labels)) if labels[k] == IGNORE_INDEX), len(labels))


def allowed(name: str, messages: list) -> bool:
    return not (name == "gemma" and messages[0]["role"] == "system")   # Gemma's template refuses it


def rewrites(name: str, messages: list) -> bool:
    """Mistral's template puts the system message in the last user turn: a prompt renders the
    turns before an answer otherwise than the whole conversation does."""
    return name.startswith("mistral") and messages[0]["role"] == "system"


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_every_answer_follows_the_prompt_the_model_is_served(family, conversation):
    name, tokenizer = family
    messages = CONVERSATIONS[conversation]
    if not allowed(name, messages):
        pytest.skip("Gemma's template refuses a system message")
    text, ids, labels = rendered(tokenizer, messages)
    assert len(text.spans) == len(answer_turns(messages)) >= 2
    position = 0
    for i in answer_turns(messages):
        prompt = served(tokenizer, messages[:i])
        assert prompt == chat_render.generation_prompt_ids(tokenizer, tokenizer.chat_template,
                                                           messages[:i])
        start = answer_start(labels, position)
        if rewrites(name, messages):
            assert ids[:start] != prompt   # the template's doing: prompt_check says so (below)
        else:
            assert ids[:start] == prompt, f"{name}, message {i + 1}"
            assert all(label == IGNORE_INDEX for label in labels[position:start])
        # the answer's ids: those the tokenizer gives its text right after the served prompt
        prefix = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True,
                                               tokenize=False)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if through.startswith(prefix):
            whole = tokenizer(through, add_special_tokens=False)["input_ids"]
            assert whole[:len(prompt)] == prompt
            answer = whole[len(prompt):]
            assert ids[start:start + len(answer)] == labels[start:start + len(answer)] == answer
            position = start + len(answer)
        else:
            position = answer_end(labels, start)
    assert all(label == IGNORE_INDEX for label in labels[position:])


def test_the_check_passes_every_family_and_says_where_a_template_rewrites_earlier_turns(family):
    name, tokenizer = family
    for messages in CONVERSATIONS:
        if not allowed(name, messages):
            continue
        text, _, _ = rendered(tokenizer, messages)
        segments = chat_render.segment_ids(tokenizer, [text.segments()])[0]
        found = chat_render.prompt_check(tokenizer, tokenizer.chat_template, messages, text,
                                         segments)
        if not rewrites(name, messages):
            assert found == []
            continue
        # with an answer last, the whole conversation has no system message at all
        assert [(d.turn, d.rewritten) for d in found] == [(3, True), (5, True)]
        assert found[0].message == ("character 11 differs: trained 'List two fruits.[/INST]', "
                                    "served 'You are terse.\\n\\nList two fruits.[/INST]'")
        # the answers are found in the whole rendering all the same
        assert [text.text[a:b] for a, b in text.spans] == [" - apple\n- pear</s>",
                                                           " - red\n- blue</s>"]


@pytest.mark.parametrize("loss_on", ["answers", "all"])
def test_loss_on_all_keeps_the_same_ids(family, loss_on):
    _, tokenizer = family
    _, ids, labels = rendered(tokenizer, CONVERSATIONS[0], loss_on)
    assert ids == rendered(tokenizer, CONVERSATIONS[0], "answers")[1]
    assert (labels == ids) == (loss_on == "all")


def test_prompt_completion_records_are_prompted_as_trained(family):
    _, tokenizer = family
    spec = spec_for(records="prompt_completion")
    record_text = RecordText(spec, tokenizer, "prompt_completion", tokenizer.chat_template, "train")
    record = {"prompt": "What is 12 + 30?", "completion": "12 + 30 = 42."}
    ids, labels = chat_render.encode(tokenizer, [record_text(record, "test:1")], False)[0]
    start = answer_start(labels.tolist(), 0)
    user = [{"role": "user", "content": record["prompt"]}]
    assert ids[:start].tolist() == served(tokenizer, user)


def test_the_whole_conversation_tokenised_at_once_is_not_the_served_prompt():
    """GPT-2's regex splits '\\n\\n' before a word: tokenised at once the conversation ends the
    prompt 'Ċ' 'Ċ', the served prompt ends 'ĊĊ'. The segments give the first answer its served
    prompt; a later one cannot have it (its served prompt holds the earlier answer as 'Ċ' 'Ċ' +
    text, training holds it as the model writes it), and the check names the tokens."""
    tokenizer = gpt2_style()
    messages = CONVERSATIONS[0]
    prompt = served(tokenizer, messages[:1])
    assert tokenizer.convert_ids_to_tokens(prompt[-2:]) == ["<|end_header_id|>", "ĊĊ"]
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    at_once = tokenizer(full, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(at_once[len(prompt) - 1:len(prompt) + 1]) == ["Ċ", "Ċ"]
    text, ids, labels = rendered(tokenizer, messages)
    assert ids[:answer_start(labels, 0)] == prompt
    segments = chat_render.segment_ids(tokenizer, [text.segments()])[0]
    found = chat_render.prompt_check(tokenizer, tokenizer.chat_template, messages, text, segments)
    assert [(d.turn, d.rewritten) for d in found] == [(4, False), (6, False)]
    trained, served_part = found[0].message.split(", served ")
    assert trained.startswith("token 13 of 38 differs: trained ")
    assert "'<|end_header_id|>' 'ĊĊ' 'Hello'" in trained
    assert "'<|end_header_id|>' 'Ċ' 'Ċ' 'Hello'" in served_part


def test_a_segment_keeps_the_ids_it_has_after_its_context():
    """A SentencePiece tokenizer puts '▁' before a text that starts the input: an answer tokenised
    alone would get one it does not have after its prompt."""
    tokenizer = mistral(metaspace=True)
    prompt, answer = "<s>[INST] Hi[/INST]", "Hello</s>"
    alone = tokenizer(answer, add_special_tokens=False)["input_ids"]
    whole = tokenizer(prompt + answer, add_special_tokens=False)["input_ids"]
    first, second = chat_render.segment_ids(tokenizer, [[prompt, answer]])[0]
    assert first + second == whole and second != alone
    assert tokenizer.convert_ids_to_tokens(alone)[0] == "▁"


def test_the_shipped_tokenizer_keeps_the_blank_line_one_token():
    """jobs/data/tokenizer splits as Llama 3's does: the prompt ends 'ĊĊ' before the answer's
    first word, tokenised segment by segment or the whole conversation at once."""
    tokenizer = shipped()
    pre_tokenizer = json.loads((SHIPPED / "tokenizer.json").read_text())["pre_tokenizer"]
    split = pre_tokenizer["pretokenizers"]
    assert split[0]["pattern"]["Regex"] == LLAMA3_SPLIT and split[1]["type"] == "ByteLevel"
    messages = CONVERSATIONS[0]
    _, ids, labels = rendered(tokenizer, messages)
    start = answer_start(labels, 0)
    assert tokenizer.convert_ids_to_tokens(ids[start - 2:start]) == ["<|end_header_id|>", "ĊĊ"]
    assert tokenizer.decode(ids[start:start + 4]).startswith("Hello")
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer(full, add_special_tokens=False)["input_ids"] == ids


# --- the data preparation pass, the evaluation prompts, the export -------------------------------

@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JOBSPEC_CACHE_DIR", str(tmp_path / "cache"))


def write_records(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    return path


def test_a_tokenizer_that_joins_text_across_the_cut_gets_a_note_for_later_answers(tmp_path,
                                                                                  own_cache):
    """GPT-2's pre-tokenizer splits a blank line before a word, so an answer's end tokenises one way
    where the answer ends and another where the conversation goes on: the first answer's prompt is
    still the served one; the later ones are noted, and the data is prepared."""
    tokenizer = gpt2_style()
    tokenizer.save_pretrained(tmp_path / "tok")
    data = write_records(tmp_path / "chat.jsonl", [CONVERSATIONS[1][:2], CONVERSATIONS[0]])
    entry = data_prep.prepare_split(spec_for(data, tmp_path / "tok"), "train", tokenizer)
    note = data_prep.prompt_note_line(entry)
    assert note is not None and f"({data}:2, message 4:" in note and "'ĊĊ'" in note
    assert "answers after the first" in note and "Llama 3" in note
    assert entry.data is not None


def test_a_first_answer_whose_ids_are_not_the_served_prompt_refuses_the_data(tmp_path, own_cache,
                                                                             monkeypatch):
    """The first answer's prompt is the served one by construction; ids that differ there (here a
    token dropped from the first segment) are a fault, named at the record, and nothing is cached."""
    tokenizer = llama3()
    tokenizer.save_pretrained(tmp_path / "tok")
    data = write_records(tmp_path / "chat.jsonl", CONVERSATIONS)
    segment_ids = chat_render.segment_ids

    def dropped(tok, records):
        return [[record[0][:-1], *record[1:]] for record in segment_ids(tok, records)]

    monkeypatch.setattr(chat_render, "segment_ids", dropped)
    with pytest.raises(SpecError) as caught:
        data_prep.prepare_split(spec_for(data, tmp_path / "tok"), "train", tokenizer)
    issue = caught.value.issues[0]
    assert issue.message.startswith(f"{data}:1: message ")
    assert "not the prompt the model is served" in issue.message
    assert not list((tmp_path / "cache" / "data").glob("[!.]*"))


def test_the_pass_notes_a_template_that_rewrites_earlier_turns(tmp_path, own_cache):
    tokenizer = mistral()
    tokenizer.save_pretrained(tmp_path / "tok")
    data = write_records(tmp_path / "chat.jsonl", CONVERSATIONS)
    entry = data_prep.prepare_split(spec_for(data, tmp_path / "tok"), "train", tokenizer)
    note = data_prep.prompt_note_line(entry)
    assert note is not None
    assert note.startswith("data.train: the chat template renders the turns before an answer")
    assert f"({data}:4, message 3: character 11 differs" in note


def test_the_cache_holds_the_served_prompts_and_the_eval_generation_builds_them(tmp_path,
                                                                                 own_cache):
    """End to end on the shipped tokenizer: the cached ids before each answer are the prompt
    train/generation.build_prompts makes of the record up to that answer."""
    from jobspec.model.build import build_tokenizer
    from jobspec.train import generation

    data = write_records(tmp_path / "chat.jsonl", CONVERSATIONS)
    spec = spec_for(data)
    tokenizer = build_tokenizer(spec)
    entry = data_prep.prepare_split(spec, "train", tokenizer)
    assert entry.data is not None and data_prep.prompt_note_line(entry) is None
    for index, messages in enumerate(CONVERSATIONS):
        ids, labels = (array.tolist() for array in entry.data.sample(index))
        position = 0
        for i in answer_turns(messages):
            start = answer_start(labels, position)
            prompt = generation.build_prompts(spec, tokenizer, tokenizer.chat_template,
                                              [{"messages": messages[:i + 1]}])[0]
            assert prompt.reference == messages[i]["content"]
            assert prompt.ids == ids[:start] == served(tokenizer, messages[:i])
            position = answer_end(labels, start)


def test_the_exported_tokenizer_serves_the_trained_prompt(tmp_path, own_cache):
    """The export writes the tokenizer with the job's template file: transformers'
    apply_chat_template on the exported directory gives the ids training put before each answer."""
    from transformers import AutoTokenizer

    from jobspec.export.hf_dir import ExportInfo, write_model_dir
    from jobspec.model.build import build_model, build_tokenizer

    template = tmp_path / "template.jinja"   # one blank line less after each header
    template.write_text(LLAMA3_TEMPLATE.replace("'\n\n'+", "'\n'+").replace(">\n\n'", ">\n'"))
    data = write_records(tmp_path / "chat.jsonl", CONVERSATIONS)
    spec = spec_for(data, chat_template=str(template))
    tokenizer = build_tokenizer(spec)
    entry = data_prep.prepare_split(spec, "train", tokenizer)
    write_model_dir(tmp_path / "model", spec, dict(build_model(spec, tokenizer).state_dict()),
                    ExportInfo(name="final", step=1, dtype="fp32", source="a test", metrics={},
                               notes=[]), tokenizer=tokenizer)
    exported = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert exported.chat_template == template.read_text()
    messages = CONVERSATIONS[2]
    ids, labels = (array.tolist() for array in entry.data.sample(2))
    position = 0
    for i in answer_turns(messages):
        start = answer_start(labels, position)
        prompt = served(exported, messages[:i])
        assert prompt == ids[:start]
        assert exported.decode(prompt).endswith("assistant<|end_header_id|>\n")
        position = answer_end(labels, start)
