"""Generate the shipped sample data and tokenizer under jobs/data/ (deterministic; the outputs are committed).

    python scripts/make_sample_data.py            # rewrite jobs/data/
    python scripts/make_sample_data.py --out DIR  # write elsewhere (tests/train/test_sample_data.py compares)

- corpus-sample.txt     plain text, one document per line (data.format text, document: line)
- chat-sample.jsonl     chat records {"messages": [{role, content}, ...]}: system/user/assistant, some multi-turn
- instruct-sample.jsonl prompt/completion records {"prompt", "completion"} of mixed lengths
- tokenizer/            a byte-level BPE (vocabulary VOCAB_SIZE, special tokens included) trained on the
                        text above with Llama 3's pre-tokenizer, saved as a Hugging Face fast
                        tokenizer with bos/eos/pad tokens and a Llama-3-style chat template in
                        tokenizer_config.json

The text is synthetic but readable: templates filled from word lists with a seeded random generator, so
no download is needed and the same run always writes the same bytes.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SEED = 24
VOCAB_SIZE = 2048
CORPUS_DOCS = 400
CHAT_RECORDS = 300
INSTRUCT_RECORDS = 300
OUT = Path(__file__).resolve().parent.parent / "jobs" / "data"

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
HEADER_START, HEADER_END, EOT = "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, HEADER_START, HEADER_END, EOT]
# Llama 3's pre-tokenizer pattern (its tokenizer.json): contractions, words with one leading
# non-letter, numbers of up to 3 digits, punctuation with the newlines after it, runs of newlines
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's template: BOS, then each message as a header with its role, a blank line, the trimmed
# content and <|eot_id|>; the generation prompt is the assistant header
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim"
    " + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)

NAMES = ["Ada", "Ben", "Chloe", "Dev", "Elena", "Farid", "Grace", "Hugo", "Iris", "Jonas", "Keiko", "Liam", "Maya",
         "Noor", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Victor", "Wen", "Yara", "Zoe"]
PLACES = ["the old harbour", "a quiet village", "the city library", "the mountain hut", "the river bank",
          "the night market", "a small bakery", "the train station", "the botanical garden", "the school lab",
          "a fishing boat", "the museum", "the roof terrace", "the forest path", "the community hall"]
TIMES = ["at dawn", "in the afternoon", "late at night", "every Sunday", "after the storm", "in early spring",
         "during the long winter", "before breakfast", "on a rainy Tuesday", "at the end of summer"]
ADJECTIVES = ["quiet", "bright", "curious", "ancient", "careful", "gentle", "noisy", "patient", "clever", "tired",
              "hungry", "brave", "tiny", "enormous", "cheerful", "stubborn", "golden", "muddy", "fragile", "swift"]
ANIMALS = ["cat", "fox", "heron", "beetle", "otter", "sparrow", "goat", "owl", "dolphin", "tortoise", "bee",
           "hedgehog", "crow", "salmon", "rabbit"]
OBJECTS = ["lantern", "notebook", "bicycle", "teapot", "map", "telescope", "basket", "violin", "compass", "kite",
           "umbrella", "clock", "letter", "garden hose", "wooden box"]
VERBS_PAST = ["found", "carried", "repaired", "painted", "lost", "borrowed", "studied", "measured", "cleaned",
              "described", "opened", "hid", "counted", "sold", "photographed"]
FEELINGS = ["surprised", "delighted", "puzzled", "calm", "proud", "nervous", "grateful", "amused", "restless"]
WEATHER = ["cold", "windy", "warm", "foggy", "sunny", "wet", "humid", "clear"]

TOPICS = {
    "gardening": {
        "facts": ["Tomatoes need at least six hours of sun a day.", "Compost returns nutrients to the soil.",
                  "Watering in the morning keeps leaves dry overnight.", "Mulch keeps moisture in the ground.",
                  "Bees pollinate most fruit trees.", "Clay soil holds water longer than sandy soil.",
                  "Pruning in late winter helps roses bloom.", "Seeds sprout faster in warm soil."],
        "steps": ["choose a sunny spot", "loosen the soil with a fork", "mix in a layer of compost",
                  "plant the seedlings a hand apart", "water them gently", "cover the bed with straw",
                  "check for slugs in the evening", "pull weeds while they are small"],
        "goal": "start a vegetable garden",
    },
    "cooking": {
        "facts": ["Salt draws moisture out of vegetables.", "Bread rises because yeast makes carbon dioxide.",
                  "Resting meat keeps its juices inside.", "Acid such as lemon juice brightens a sauce.",
                  "Onions turn sweet when cooked slowly.", "A sharp knife is safer than a dull one.",
                  "Rice absorbs about twice its volume of water.", "Toasting spices releases their aroma."],
        "steps": ["read the whole recipe first", "measure the ingredients", "heat the pan before adding oil",
                  "chop the onions finely", "cook them slowly until golden", "add the spices and stir",
                  "pour in the stock", "let it simmer for twenty minutes", "taste and add salt"],
        "goal": "cook a simple soup",
    },
    "astronomy": {
        "facts": ["The Moon takes about twenty-seven days to orbit the Earth.",
                  "Light from the Sun reaches us in about eight minutes.", "Jupiter is the largest planet.",
                  "Stars twinkle because of the moving air above us.", "Mars looks red because of iron oxide.",
                  "A light year is a distance, not a time.", "Saturn's rings are made of ice and rock.",
                  "The Milky Way holds hundreds of billions of stars."],
        "steps": ["find a dark place away from street lights", "let your eyes adjust for twenty minutes",
                  "use a star map to find the bright stars", "look for the planets near the ecliptic",
                  "try binoculars before buying a telescope", "write down what you see and when"],
        "goal": "start stargazing",
    },
    "programming": {
        "facts": ["A function should do one thing well.", "Tests catch mistakes before users do.",
                  "Version control keeps the history of every change.", "A list keeps its items in order.",
                  "A dictionary maps keys to values.", "Readable names make code easier to change.",
                  "Small commits are easier to review.", "An exception carries the reason for a failure."],
        "steps": ["write down what the program should do", "split the problem into small functions",
                  "write a test for the first function", "make the test pass", "commit the change",
                  "refactor the code while the tests stay green", "ask a colleague to review it"],
        "goal": "write a small program",
    },
    "travel": {
        "facts": ["Trains are often faster than planes for short trips.", "A paper map works without a battery.",
                  "Local markets are a good place to try new food.", "Travel insurance covers lost luggage.",
                  "Learning a few words of the language helps a lot.", "Walking is the best way to see a city."],
        "steps": ["decide how many days you have", "choose two or three places to visit", "book the trains early",
                  "pack light clothes in layers", "keep copies of your documents", "leave one day free"],
        "goal": "plan a short trip",
    },
    "health": {
        "facts": ["Sleep helps the body repair itself.", "Walking every day strengthens the heart.",
                  "Water makes up more than half of the body.", "Stretching keeps the muscles flexible.",
                  "Vegetables provide fibre and vitamins.", "Regular breaks rest the eyes."],
        "steps": ["go to bed at the same time each night", "walk for thirty minutes", "drink a glass of water",
                  "eat a vegetable with every meal", "stand up once an hour", "keep screens out of the bedroom"],
        "goal": "build healthier habits",
    },
}
DEFINITIONS = {
    "compass": "A compass is a tool with a magnetic needle that points north, used to find directions.",
    "telescope": "A telescope is an instrument that gathers light with lenses or mirrors to show distant objects.",
    "compost": "Compost is decayed plant material that gardeners mix into soil to feed it.",
    "recipe": "A recipe is a list of ingredients with the steps to prepare a dish.",
    "planet": "A planet is a large body that orbits a star and has cleared its path of other objects.",
    "function": "A function is a named piece of code that takes inputs and returns a result.",
    "passport": "A passport is an official document that proves who you are when you travel abroad.",
    "vitamin": "A vitamin is a substance the body needs in small amounts to work well.",
    "glacier": "A glacier is a slow river of ice formed from snow pressed together over many years.",
    "volcano": "A volcano is an opening in the ground where molten rock, ash and gas escape.",
    "library": "A library is a place that lends books and other media to the public.",
    "orchestra": "An orchestra is a large group of musicians playing strings, wind and percussion together.",
}
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a friendly tutor who explains things simply.",
                  "You are a concise assistant. Answer in a few sentences.",
                  "You are a patient teacher for beginners.", "You are a cheerful guide who likes lists."]
OPPOSITES = {"hot": "cold", "early": "late", "open": "closed", "light": "heavy", "fast": "slow", "empty": "full",
             "wide": "narrow", "loud": "quiet", "old": "new", "strong": "weak", "sharp": "dull", "rough": "smooth"}


def sentence(rng: random.Random) -> str:
    name, adj, animal, obj = rng.choice(NAMES), rng.choice(ADJECTIVES), rng.choice(ANIMALS), rng.choice(OBJECTS)
    place, time, verb = rng.choice(PLACES), rng.choice(TIMES), rng.choice(VERBS_PAST)
    templates = [
        f"{name} {verb} a {adj} {obj} near {place} {time}.",
        f"A {adj} {animal} watched {name} from {place}.",
        f"{time[0].upper()}{time[1:]}, {name} felt {rng.choice(FEELINGS)} and walked to {place}.",
        f"The weather was {rng.choice(WEATHER)}, so {name} stayed at {place} with the {obj}.",
        f"Nobody knew why the {animal} kept the {obj} {time}.",
        f"{name} and {rng.choice(NAMES)} {verb} the {obj} together.",
        rng.choice(rng.choice(list(TOPICS.values()))["facts"]),
    ]
    return rng.choice(templates)


def paragraph(rng: random.Random, low: int, high: int) -> str:
    return " ".join(sentence(rng) for _ in range(rng.randint(low, high)))


def topic_text(rng: random.Random, topic: str, low: int, high: int) -> str:
    facts = TOPICS[topic]["facts"]
    return " ".join(rng.sample(facts, min(len(facts), rng.randint(low, high))))


def corpus(rng: random.Random) -> list[str]:
    docs = []
    for _ in range(CORPUS_DOCS):
        kind = rng.random()
        if kind < 0.3:
            docs.append(paragraph(rng, 1, 3))           # short
        elif kind < 0.8:
            docs.append(paragraph(rng, 4, 12))          # medium
        else:                                           # long: several paragraphs' worth on one line
            topic = rng.choice(list(TOPICS))
            docs.append(" ".join([topic_text(rng, topic, 3, 6), paragraph(rng, 15, 40)]))
    return docs


def steps_answer(rng: random.Random, topic: str, short: bool = False) -> str:
    steps = TOPICS[topic]["steps"]
    chosen = steps[:rng.randint(3, 4)] if short else steps[:rng.randint(4, len(steps))]
    lines = [f"{i}. {s[0].upper()}{s[1:]}." for i, s in enumerate(chosen, start=1)]
    intro = "" if short else f"Here is a simple way to {TOPICS[topic]['goal']}:\n"
    return intro + "\n".join(lines)


def exchange(rng: random.Random) -> tuple[str, str]:
    """One user question and the assistant's answer."""
    topic = rng.choice(list(TOPICS))
    kind = rng.randrange(6)
    if kind == 0:
        return f"How do I {TOPICS[topic]['goal']}?", steps_answer(rng, topic)
    if kind == 1:
        term = rng.choice(list(DEFINITIONS))
        return rng.choice([f"What is a {term}?", f"Can you explain what {term} means?", f"Define {term}."]), \
            DEFINITIONS[term]
    if kind == 2:
        n = rng.randint(2, 5)
        facts = rng.sample(TOPICS[topic]["facts"], n)
        return f"Tell me {n} facts about {topic}.", "\n".join(f"- {f}" for f in facts)
    if kind == 3:
        subject = rng.choice(ANIMALS + OBJECTS)
        lines = [f"The {rng.choice(ADJECTIVES)} {subject} waits {rng.choice(TIMES)},",
                 f"near {rng.choice(PLACES)}, {rng.choice(FEELINGS)} and still.",
                 f"The air is {rng.choice(WEATHER)}; a {rng.choice(ANIMALS)} sings,",
                 "and the day goes on as days will."]
        return f"Write a short poem about a {subject}.", "\n".join(lines)
    if kind == 4:
        text = paragraph(rng, 3, 8)
        return f"Summarise this text in one sentence:\n\n{text}", f"In short: {text.split('. ')[0].rstrip('.')}."
    a, b = rng.randint(2, 999), rng.randint(2, 999)
    return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."


def chat_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(CHAT_RECORDS):
        messages = []
        if rng.random() < 0.5:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        turns = rng.choices([1, 2, 3, 4], weights=[55, 25, 15, 5])[0]
        for turn in range(turns):
            if turn > 0 and rng.random() < 0.3:
                question = rng.choice(["Can you make that shorter?", "Thanks! Could you say it in fewer words?"])
                answer = messages[-1]["content"].split("\n")[0]
            else:
                question, answer = exchange(rng)
                if turn > 0:
                    lead = rng.choice(["Thanks. ", "Great, one more: ", "", "And "])
                    question = lead + (question[0].lower() + question[1:] if lead == "And " else question)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        records.append({"messages": messages})
    return records


def instruct_records(rng: random.Random) -> list[dict]:
    records = []
    for _ in range(INSTRUCT_RECORDS):
        kind = rng.randrange(6)
        if kind == 0:
            word = rng.choice(list(OPPOSITES))
            prompt, completion = f"Give the opposite of the word '{word}'.", OPPOSITES[word]
        elif kind == 1:
            numbers = [rng.randint(1, 99) for _ in range(rng.randint(3, 9))]
            prompt = f"Sort these numbers from smallest to largest: {', '.join(map(str, numbers))}"
            completion = ", ".join(map(str, sorted(numbers)))
        elif kind == 2:
            topic = rng.choice(list(TOPICS))
            prompt, completion = f"Explain how to {TOPICS[topic]['goal']}.", steps_answer(rng, topic)
        elif kind == 3:
            text = paragraph(rng, 4, 14)
            prompt = f"Count the sentences in this text:\n\n{text}"
            completion = f"The text has {text.count('. ') + 1} sentences."
        elif kind == 4:
            name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
            prompt = f"Write a short story about {name} and a {obj}."
            completion = f"{name} found a {obj} {rng.choice(TIMES)}. " + paragraph(rng, 2, 20)
        else:
            term = rng.choice(list(DEFINITIONS))
            prompt, completion = f"Define the word '{term}'.", DEFINITIONS[term]
        records.append({"prompt": prompt, "completion": completion})
    return records


def train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=True))
    # Llama 3's: its regex split (newlines kept together, apart from the words after them), then
    # bytes: the blank line after a header is the token 'ĊĊ' whether an answer follows it (training)
    # or the text ends there (the prompt the model is served)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                      additional_special_tokens=[HEADER_START, HEADER_END, EOT],
                                      model_max_length=1024, clean_up_tokenization_spaces=False)
    wrapped.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out, save_jinja_files=False)  # the template inside tokenizer_config.json


def write_jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def generate(out: Path) -> None:
    rng = random.Random(SEED)
    docs = corpus(rng)
    chats = chat_records(rng)
    instructs = instruct_records(rng)
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus-sample.txt").write_text("".join(d + "\n" for d in docs), encoding="utf-8")
    write_jsonl(out / "chat-sample.jsonl", chats)
    write_jsonl(out / "instruct-sample.jsonl", instructs)
    texts = docs + [m["content"] for r in chats for m in r["messages"]] + \
        [t for r in instructs for t in (r["prompt"], r["completion"])] + \
        [f"{HEADER_START}{role}{HEADER_END}\n\n" for role in ("system", "user", "assistant", "tool")]
    train_tokenizer(texts, out / "tokenizer")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    main()
