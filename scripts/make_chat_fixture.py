"""Build tests/fixtures/chat/: a tiny byte-level BPE tokenizer, four chat templates, conversations and
prompt/completion exchanges, and transformers' token ids and assistant masks for each (needs transformers).

transformers is not a meshtrain dependency: install it once in a separate venv and run
    /path/to/hf-venv/bin/python scripts/make_chat_fixture.py [--out tests/fixtures/chat]
It writes tokenizer/ (tokenizer.json, tokenizer_config.json holding chatml_gen), templates/<name>.jinja,
conversations.jsonl, exchanges.jsonl and reference.json: for every template and record, the ids of
`apply_chat_template(..., tokenize=True)` and a 0/1 assistant mask, with `strftime_now` pinned to DATE.
chatml_gen's mask is transformers' own (`return_assistant_tokens_mask`); the others' is the prefix rule:
assistant turn i spans from the end of render(messages[:i], add_generation_prompt=True) to the end of
render(messages[:i + 1]) less its trailing whitespace, and a token is the assistant's when its characters
overlap a span. The tokenizer is trained on the first 40 (sorted) of the running Python's stdlib modules, less
_sysconfigdata*: the fixture's was Python 3.11.7's, and another Python trains another vocabulary.
    /path/to/hf-venv/bin/python scripts/make_chat_fixture.py --check-export FOLDER
loads a Hugging Face folder meshtrain exported, renders the first conversation without its last assistant
turn with the folder's own chat template and greedily generates 8 tokens from it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "chat"
DATE = datetime.date(2026, 1, 15)
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|user|>", "<|assistant|>", "<|system|>"]

# ChatML with tools, after Qwen2.5's template; {% generation %} marks the assistant's content and <|im_end|>.
CHATML_HEAD = r"""{% if tools %}
<|im_start|>system
{% if messages[0].role == 'system' %}
{{ messages[0].content }}

{% else %}
You are a helpful assistant.

{% endif %}
# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{% for message in messages %}
{% if message.role == 'system' and loop.first %}
{# the first system message is part of the header above #}
{% elif message.role == 'user' or message.role == 'system' %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
"""
CHATML_ASSISTANT = r"""{% if message.content %}{{ message.content }}{% endif %}
{% for tool_call in message.tool_calls or [] %}
{% set call = tool_call.function if tool_call.function is defined else tool_call %}
{% if message.content or not loop.first %}{{ '\n' }}{% endif %}
{% set arguments = call.arguments if call.arguments is string else call.arguments | tojson %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ arguments }}{{ '}' }}
</tool_call>
{%- endfor %}
<|im_end|>
"""
CHATML_TAIL = r"""{% elif message.role == 'tool' %}
{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}
<|im_start|>user
{% endif %}
<tool_response>
{{ message.content }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
<|im_end|>
{% else %}

{% endif %}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
CHATML = CHATML_HEAD + CHATML_ASSISTANT + CHATML_TAIL
CHATML_GEN = (CHATML_HEAD + "{% generation %}\n" + CHATML_ASSISTANT.removesuffix("\n")
              + "\n{%- endgeneration %}\n{{ '\\n' }}\n{%- " + CHATML_TAIL.removeprefix("{% "))

DEFAULT_SYSTEM = r"""{% set ns = namespace(system='', start=0) %}
{% if messages[0].role == 'system' %}
{% set ns.system = messages[0].content %}
{% set ns.start = 1 %}
{% else %}
{% set ns.system = 'You are a helpful assistant.\nToday is ' + strftime_now('%d %B %Y') + '.' %}
{% endif %}
<|im_start|>system
{{ ns.system }}<|im_end|>
{% for message in messages[ns.start:] %}
{% if not message.content and not message.tool_calls %}
{# skip empty messages #}
{% continue %}
{% endif %}
{% if message.role in ['system', 'user', 'tool'] %}
<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}
<|im_start|>assistant
{% if message.content %}
{{ message.content }}
{%- endif %}
{% for tool_call in message.tool_calls or [] %}
{% if message.content or not loop.first %}

{% endif %}
<tool_call>{{ tool_call.function | tojson }}</tool_call>
{%- endfor %}
<|im_end|>
{% else %}
{{ raise_exception('Unknown role: ' + message.role) }}
{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# Zephyr-like: role tags on their own line, the end-of-text token closing every turn.
EOT_BETWEEN = r"""{% for message in messages %}
{% if message.role == 'system' %}
<|system|>
{{ message.content }}{{ eos_token }}
{% elif message.role == 'user' %}
<|user|>
{{ message.content }}{{ eos_token }}
{% elif message.role == 'assistant' %}
<|assistant|>
{% if message.content %}
{{ message.content }}
{%- endif %}
{% if message.tool_calls %}
{% for tool_call in message.tool_calls %}
{% if message.content or not loop.first %}

{% endif %}
[tool call] {{ tool_call.function.name }}({{ tool_call.function.arguments | tojson }})
{%- endfor %}
{% endif %}
{{ eos_token }}
{% elif message.role == 'tool' %}
<|user|>
[tool result] {{ message.content }}{{ eos_token }}
{% else %}
{{ raise_exception('Unknown role: ' + message.role) }}
{% endif %}
{% if loop.last and add_generation_prompt %}
<|assistant|>
{% endif %}
{% endfor %}
"""
TEMPLATES = {"chatml_gen": CHATML_GEN, "chatml": CHATML, "default_system": DEFAULT_SYSTEM, "eot_between": EOT_BETWEEN}


def pin_date() -> None:
    """Make transformers' `strftime_now` see DATE (it calls the module's `datetime.now()`)."""
    from transformers.utils import chat_template_utils

    class Pinned(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(DATE.year, DATE.month, DATE.day)

    chat_template_utils.datetime = Pinned


# ----------------------------------------------------------------------------------------------- tokenizer

def training_texts() -> list[str]:
    files = sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py")
                   if not p.name.startswith("_sysconfigdata"))  # build paths of this machine, not Python
    return [p.read_text(encoding="utf-8") for p in files[:40]]


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_texts(), trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=False) + "\n", encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>",
              "pad_token": "<|endoftext|>", "unk_token": None, "clean_up_tokenization_spaces": False,
              "model_max_length": 4096, "chat_template": CHATML_GEN}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------------------------- records

def tool(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = tool("get_weather", "Get the current weather in a city.", {
    "city": {"type": "string", "description": "The city name, e.g. Paris"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
CURRENCY = tool("convert_currency", "Convert an amount of money between two currencies.", {
    "amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}}, ["amount", "from", "to"])
SEARCH = tool("search_docs", "Search the project documentation.", {
    "query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1, "maximum": 20}}, ["query"])
PYTHON = tool("run_python", "Run a Python snippet in a sandbox and return its stdout.", {
    "code": {"type": "string", "description": "The source code to run"}}, ["code"])


def sys_(text: str) -> dict:
    return {"role": "system", "content": text}


def user(text: str, **extra) -> dict:
    return {"role": "user", "content": text, **extra}


def bot(text: str | None, *calls: tuple[str, dict], **extra) -> dict:
    message = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return {**message, **extra}


def tool_result(content: str, **extra) -> dict:
    return {"role": "tool", "content": content, **extra}


FIB = '''```python
def fib(n):
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
```'''
FIB_TYPED = '''```python
def fib(n: int) -> int:
    """The n-th Fibonacci number (fib(0) == 0)."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
```'''
REVIEW_CODE = '''import json
from pathlib import Path


class Cache:
    def __init__(self, folder):
        self.folder = Path(folder)
        self.hits = 0

    def get(self, key):
        path = self.folder / (key + ".json")
        if path.exists():
            self.hits += 1
            return json.loads(path.read_text())
        return None

    def put(self, key, value):
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / (key + ".json")).write_text(json.dumps(value))
'''
REVIEW_ANSWER = '''A few things stand out:

1. `key + ".json"` trusts the key: a key like `../../etc/passwd` escapes the folder. Validate it, e.g.
   `if not key.isidentifier(): raise ValueError(key)`, or hash it with `hashlib.sha256(key.encode()).hexdigest()`.
2. `put` is not atomic. If the process dies halfway, the next `get` reads half a file and `json.loads` raises.
   Write to a temporary file in the same folder and `os.replace` it into place.
3. `exists()` followed by `read_text()` is a race: another process may delete the file in between. Catch
   `FileNotFoundError` instead of asking first.
4. `hits` counts hits but nothing counts misses, so the hit rate cannot be computed.

Here is a version with all four fixed:

```python
import hashlib
import json
import os
import tempfile
from pathlib import Path


class Cache:
    def __init__(self, folder):
        self.folder = Path(folder)
        self.hits = self.misses = 0

    def _path(self, key):
        return self.folder / (hashlib.sha256(key.encode()).hexdigest() + ".json")

    def get(self, key):
        try:
            value = json.loads(self._path(key).read_text())
        except FileNotFoundError:
            self.misses += 1
            return None
        self.hits += 1
        return value

    def put(self, key, value):
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, self._path(key))
```
'''
SCHEDULE_ANSWER = '''Warmup exists because the first updates are the least trustworthy. At initialization the Adam
second-moment estimates are built from a handful of gradients, so the per-parameter step sizes are noisy; a full
learning rate applied to them can push the weights into a region the model never recovers from (the loss spikes, or the
attention logits grow until softmax saturates).

A linear warmup over the first 1-5% of the steps keeps the early steps small while those statistics settle.
After it, cosine decay lowers the rate smoothly towards a floor, which is usually 10% of the peak:

    lr(t) = peak * t / warmup                                   for t < warmup
    lr(t) = floor + (peak - floor) * (1 + cos(pi * p)) / 2      with p = (t - warmup) / (total - warmup)

Two practical notes:

- The decay length should match the real number of steps. If you stop a cosine schedule early, the model never
  sees the low-learning-rate phase, which is where much of the final loss improvement happens.
- If you want to be able to extend a run, consider warmup-stable-decay instead: a constant rate after warmup and
  a short decay at the end, so that any checkpoint from the stable phase can be decayed later.'''


def conversations() -> list[dict]:
    return handwritten() + templated()


def handwritten() -> list[dict]:
    return [
        {"messages": [
            sys_("You are a concise assistant for a machine-learning team."),
            user("What does gradient accumulation do?"),
            bot("It sums the gradients of several micro-batches before one optimizer step, so you train with a large "
                "effective batch while only holding a small one in memory."),
            user("And when should I use it?"),
            bot("When the batch size you want does not fit on your devices. It costs time, not memory: k micro-batches "
                "take k forward and backward passes per step.")]},
        {"messages": [
            user("Hi! Can you help me name a variable?", name=None),
            bot("Of course. What does the variable hold?", tool_calls=None),
            user("The number of tokens seen so far in training."),
            bot("`tokens_seen` is short and clear. If it lives next to other counters, `num_tokens_seen` reads well "
                "too.", tool_calls=None, name=None),
            user("Great, thanks."),
            bot("You're welcome!", tool_calls=None)]},
        {"tools": [WEATHER], "messages": [
            sys_("You are a weather assistant. Use the tools when you need live data."),
            user("What's the weather like in Paris right now?"),
            bot(None, ("get_weather", {"city": "Paris", "unit": "celsius"})),
            tool_result('{"temperature": 14, "condition": "cloudy", "humidity": 0.81}'),
            bot("It is 14 °C and cloudy in Paris, with 81% humidity."),
            user("And in Tokyo, in Fahrenheit?"),
            bot(None, ("get_weather", {"city": "Tokyo", "unit": "fahrenheit"})),
            tool_result('{"temperature": 48, "condition": "clear"}'),
            bot("Tokyo is clear at 48 °F.")]},
        {"tools": [WEATHER, CURRENCY], "messages": [
            user("I'm flying to Zürich tomorrow. How warm is it there, and what are 250 euros in Swiss francs?"),
            bot(None, ("get_weather", {"city": "Zürich"}),
                ("convert_currency", {"amount": 250, "from": "EUR", "to": "CHF"})),
            tool_result('{"temperature": 3, "condition": "snow"}', name="get_weather"),
            tool_result('{"amount": 233.75, "currency": "CHF"}', name="convert_currency"),
            bot("Pack warm clothes: it is 3 °C and snowing in Zürich. 250 € are about 233.75 CHF."),
            user("Thanks. Is the exchange rate likely to change much by tomorrow?"),
            bot("Day-to-day moves between the euro and the franc are usually well under 1%, so the figure should hold "
                "within a couple of francs.")]},
        {"messages": [
            sys_("Réponds dans la langue de l'utilisateur."),
            user("Peux-tu m'expliquer ce qu'est une fonction de perte ? Ça me paraît très abstrait."),
            bot("Bien sûr ! Une fonction de perte mesure l'écart entre la prédiction du modèle et la réponse attendue. "
                "L'entraînement consiste à la rendre la plus petite possible, pas à pas."),
            user("损失函数和准确率有什么区别？"),
            bot("准确率只统计预测对了多少；损失函数是连续的，可以求导，所以优化器能沿着它的梯度改进模型。"),
            user("ありがとう！最後に一言でまとめてください 🙏"),
            bot("損失は「どれだけ間違えたか」の滑らかな尺度です ✨🚀")]},
        {"messages": [
            user("Write a Python function that returns the n-th Fibonacci number."),
            bot("Here is an iterative version, which runs in O(n) time and O(1) memory:\n\n" + FIB),
            user("Can you add type hints and reject negative n?"),
            bot(FIB_TYPED + "\n\n`fib(10)` returns `55`."),
            user("Why not recursion?"),
            bot("The naive recursive version recomputes the same values exponentially often, and Python's recursion "
                "limit (1000 by default) caps n anyway.")]},
        {"messages": [
            user("   is whitespace around a message kept?   "),
            bot("  Yes: the template copies the content as it is, spaces included.  "),
            user("\tEven tabs?\n"),
            bot("Even tabs and newlines.\n"),
            user("And a leading newline?"),
            bot("\nLike this one.")]},
        {"messages": [
            user(""),
            user("Sorry, I hit enter too early. How do I reverse a list in Python?"),
            bot("Use `xs[::-1]` for a reversed copy, or `xs.reverse()` to reverse it in place."),
            user("Which one is faster?"),
            bot("`xs.reverse()` does not allocate a new list, so it is a little faster and uses less memory.")]},
        {"messages": [
            sys_("You are a support agent for a cloud GPU provider."),
            user("My job was preempted twice today."),
            bot("I'm sorry about that. Spot instances can be reclaimed at any time; checkpointing every few hundred "
                "steps limits what you lose."),
            sys_("The user is on the free tier. Do not promise refunds."),
            user("Will I get the lost hours back?"),
            bot("Free-tier hours are not refunded, but the preempted minutes were not counted against your quota.")]},
        {"tools": [SEARCH], "messages": [
            sys_("You answer questions about the meshtrain project."),
            user("How do I resume a run from its last checkpoint?"),
            bot("Let me check the documentation.", ("search_docs", {"query": "resume from checkpoint", "limit": 3})),
            tool_result('[{"title": "Checkpoints", "text": "Pass the same run.dir: training resumes from the newest '
                        'complete checkpoint."}]'),
            bot("Run the same command with the same `run.dir`; training picks up from the newest complete "
                "checkpoint."),
            user("And if the newest one is corrupt?"),
            bot("Then it is not complete: only checkpoints whose write finished count, so the one before it is "
                "used.")]},
        {"messages": [
            sys_("You are a senior Python reviewer. Be specific and show code."),
            user("Please review this cache class:\n\n```python\n" + REVIEW_CODE + "```"),
            bot(REVIEW_ANSWER),
            user("Why `os.replace` and not `os.rename`?"),
            bot("`os.replace` overwrites an existing destination on every platform; `os.rename` raises on Windows "
                "when the destination exists. On POSIX both are atomic within one file system."),
            user("Should the temporary file be removed if `json.dump` fails?"),
            bot("Yes. Wrap the write in `try` and call `os.unlink(tmp)` in the `except` branch before re-raising, "
                "otherwise failed writes leave `.tmp` files behind.")]},
        {"tools": [PYTHON], "messages": [
            sys_("You are a tutor for deep-learning engineers."),
            user("Why do people use a learning-rate warmup followed by cosine decay?"),
            bot(SCHEDULE_ANSWER),
            user("Can you print the schedule at a few steps for peak 3e-4, 100 warmup steps, 1000 total?"),
            bot(None, ("run_python", {"code": "import math\nfor t in (0, 50, 100, 550, 1000):\n"
                                              "    p = max(0, (t - 100) / 900)\n"
                                              "    lr = 3e-4 * t / 100 if t < 100 else "
                                              "3e-5 + 2.7e-4 * (1 + math.cos(math.pi * p)) / 2\n"
                                              "    print(t, f'{lr:.2e}')"})),
            tool_result("0 0.00e+00\n50 1.50e-04\n100 3.00e-04\n550 1.65e-04\n1000 3.00e-05"),
            bot("| step | learning rate |\n|---:|---:|\n| 0 | 0 |\n| 50 | 1.5e-4 |\n| 100 | 3.0e-4 |\n"
                "| 550 | 1.65e-4 |\n| 1000 | 3.0e-5 |\n\nThe peak is reached at step 100 and the floor at the last "
                "step.")]},
        {"tools": [WEATHER], "messages": [
            user("Quel temps fait-il à Montréal et à 北京 ?"),
            bot(None, ("get_weather", {"city": "Montréal", "unit": "celsius"}),
                ("get_weather", {"city": "北京", "unit": "celsius"})),
            tool_result('{"temperature": -12, "condition": "neige légère"}'),
            tool_result('{"temperature": 2, "condition": "晴"}'),
            bot("À Montréal il fait -12 °C avec une neige légère ; à Pékin (北京) il fait 2 °C et le ciel est "
                "dégagé ☀️.")]},
        {"messages": [
            user("Compare SGD and Adam in a short list."),
            bot("- **SGD**: one learning rate for all parameters; little memory; often generalizes well.\n"
                "- **Adam**: per-parameter step sizes from running moments; two extra buffers per parameter; "
                "robust to badly scaled gradients."),
            user("Which is the default for transformers?"),
            bot("AdamW, i.e. Adam with decoupled weight decay, almost always.")]},
        {"messages": [
            sys_("You explain Jinja templates."),
            user("What does `{{ name | upper }}` print, and what about {% raw %}?"),
            bot("`{{ name | upper }}` prints the variable `name` in upper case. `{% raw %}...{% endraw %}` prints "
                "its body literally, so `{{` inside it is not evaluated."),
            user("And {# this #}?"),
            bot("`{# ... #}` is a comment: it renders nothing.")]},
        {"messages": [
            user("Line endings test:\r\nfirst line\r\nsecond line"),
            bot("I see two lines after the first, separated by Windows line endings (\\r\\n)."),
            user("Now with unusual characters: naïve café, Ærø, Ελληνικά, русский, עברית, 🧪🧬."),
            bot("All of them are valid UTF-8; a byte-level tokenizer can encode any of them, falling back to single "
                "bytes for rare characters.")]},
    ]


TOPICS = [
    ("mixed precision", "Training in mixed precision keeps a float32 master copy of the weights while computing in "
     "bfloat16.", "It halves activation memory and roughly doubles matmul throughput on modern accelerators.",
     "Loss scaling is needed for float16, whose range is small, but usually not for bfloat16."),
    ("data parallelism", "Data parallelism gives every device a full copy of the model and a slice of the batch.",
     "After the backward pass the gradients are averaged with an all-reduce.",
     "It stops scaling once the model no longer fits on one device; then you shard the parameters too."),
    ("tokenization", "A tokenizer turns text into integer ids from a fixed vocabulary.",
     "Byte-level BPE starts from the 256 bytes and repeatedly merges the most frequent adjacent pair.",
     "Because every byte is in the vocabulary, no input is ever out of vocabulary."),
    ("checkpointing", "A checkpoint stores the parameters, the optimizer state and the step counter.",
     "Saving asynchronously lets training continue while the files are written.",
     "Keep at least two checkpoints so that one corrupt write never loses the whole run."),
    ("gradient clipping", "Gradient clipping rescales the gradient when its global norm exceeds a threshold.",
     "It protects training from rare huge updates caused by outlier batches.",
     "A threshold of 1.0 is a common default for transformer pre-training."),
    ("attention", "Self-attention lets every position mix information from every earlier position.",
     "Its cost grows with the square of the sequence length.",
     "Grouped-query attention shares keys and values between heads to shrink the KV cache."),
    ("evaluation", "Evaluation runs the model on held-out data without updating it.",
     "Perplexity is the exponential of the mean token loss.",
     "Evaluate on a fixed set of batches so that numbers from different steps are comparable."),
    ("pipeline parallelism", "Pipeline parallelism splits the layers into stages on different devices.",
     "Micro-batches flow through the stages so that several are in flight at once.",
     "The idle time at the start and end of each step is called the pipeline bubble."),
    ("weight decay", "Weight decay pulls the parameters towards zero at every step.",
     "AdamW applies it directly to the weights instead of adding it to the gradient.",
     "Biases and norm scales are usually excluded from decay."),
    ("learning-rate finder", "A learning-rate finder trains briefly while increasing the rate exponentially.",
     "The loss first falls, then explodes once the rate is too high.",
     "A good peak rate is a few times smaller than the rate where the loss was lowest."),
]
QUESTIONS = ["What is {t}, in one sentence?", "Why does {t} matter in practice?", "Any pitfall with {t}?"]
SYSTEMS = ["You are a patient teacher for new ML engineers.", "Answer briefly and precisely."]


def templated() -> list[dict]:
    records = []
    for k, (topic, *answers) in enumerate(TOPICS):
        turns = 2 + k % 2  # two or three question/answer pairs
        messages = [sys_(SYSTEMS[k % 4 // 2])] if k % 4 < 2 else []
        for q, a in zip(QUESTIONS[:turns], answers):
            messages += [user(q.format(t=topic)), bot(a, **({"tool_calls": None} if k % 3 == 0 else {}))]
        records.append({"messages": messages})
    return records


EXCHANGES = [
    ("Translate to German: 'The model is training.'", "Das Modell wird trainiert."),
    ("Complete the body only:\ndef add(a, b):", "    return a + b"),
    ("Write a one-line Python expression that squares the numbers 0 to 4.",
     "```python\n[x * x for x in range(5)]\n```"),
    ("用一句话解释过拟合。", "过拟合是指模型记住了训练数据的细节，却在新数据上表现变差。"),
    ("List three primary colors, one per line.", "Red\nYellow\nBlue"),
    ("  Reply with a single emoji.  ", "👍"),
]


# ----------------------------------------------------------------------------------------------- reference

def render(tok, template: str, messages: list[dict], tools, generation_prompt: bool) -> str:
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False,
                                   add_generation_prompt=generation_prompt)


def ids_of(tok, template: str, messages: list[dict], tools) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def generation_mask(tok, template: str, messages: list[dict], tools, ids: list[int]) -> list[int]:
    out = tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True)
    assert list(out["input_ids"]) == ids
    return list(out["assistant_masks"])


def assistant_spans(tok, template: str, messages: list[dict], tools) -> tuple[str, list[tuple[int, int]]]:
    """The full rendering and, per assistant turn, its character span by the prefix rule."""
    full = render(tok, template, messages, tools, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        assert i > 0, "a conversation cannot start with the assistant"
        prompt = render(tok, template, messages[:i], tools, True)
        upto = render(tok, template, messages[:i + 1], tools, False)
        assert full.startswith(upto) and upto.startswith(prompt), (template[:30], i)
        spans.append((len(prompt), len(upto.rstrip())))
    return full, spans


def prefix_mask(tok, template: str, messages: list[dict], tools, ids: list[int]) -> tuple[list[int], int]:
    """The prefix-rule mask, and how many masked tokens reach outside their span."""
    full, spans = assistant_spans(tok, template, messages, tools)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    assert list(enc["input_ids"]) == ids
    mask, straddling = [], 0
    for a, b in enc["offset_mapping"]:
        hit = [(lo, hi) for lo, hi in spans if b > lo and a < hi]
        mask.append(int(bool(hit)))
        straddling += any(a < lo or b > hi for lo, hi in hit)
    return mask, straddling


def exchange_messages(prompt: str, completion: str) -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]


def reference(tok, raw, records: list[dict], exchanges: list[dict]) -> dict:
    chats = [(r["messages"], r.get("tools")) for r in records]
    chats += [(exchange_messages(e["prompt"], e["completion"]), None) for e in exchanges]
    out = {}
    for name, template in TEMPLATES.items():
        entries, straddling = [], 0
        for messages, tools in chats:
            ids = ids_of(tok, template, messages, tools)
            assert raw.encode(render(tok, template, messages, tools, False), add_special_tokens=False).ids == ids
            if name == "chatml_gen":
                mask = generation_mask(tok, template, messages, tools, ids)
                plain, extra = prefix_mask(tok, CHATML, messages, tools, ids)
                assert render(tok, CHATML, messages, tools, False) == render(tok, template, messages, tools, False)
                assert plain == mask, "prefix rule on chatml differs from transformers' generation mask"
            else:
                mask, extra = prefix_mask(tok, template, messages, tools, ids)
            assert len(mask) == len(ids)
            entries.append({"ids": ids, "mask": mask})
            straddling += extra
        n = len(records)
        out[name] = {"conversations": entries[:n], "exchanges": entries[n:]}
        total, masked = sum(len(e["ids"]) for e in entries), sum(sum(e["mask"]) for e in entries)
        print(f"{name:15s} {total:6d} tokens, {masked:6d} masked, {straddling} masked tokens straddle a span edge")
    print("chatml_gen: transformers' generation mask == the prefix rule on chatml, for every record")
    return out


def show_masked(tok, name: str, entry: dict) -> None:
    """Print the masked runs of one record, decoded, to check that they are exactly the assistant turns."""
    runs, run = [], []
    for token, bit in zip(entry["ids"], entry["mask"]):
        if bit:
            run.append(token)
        elif run:
            runs.append(run)
            run = []
    runs += [run] if run else []
    print(f"{name}: " + " | ".join(repr(tok.decode(r)) for r in runs))


# ----------------------------------------------------------------------------------------------- writing

def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def write_reference(path: Path, templates: dict) -> None:
    """One line per record, so the file stays small and a diff shows which record changed."""
    compact = {"separators": (",", ":")}
    parts = ['{"date": "%s", "templates": {' % DATE.isoformat()]
    for t, (name, sets) in enumerate(templates.items()):
        parts.append(f'\n"{name}": {{')
        for s, (kind, entries) in enumerate(sets.items()):
            lines = ",\n".join(json.dumps(e, **compact) for e in entries)
            parts.append(f'\n"{kind}": [\n{lines}\n]' + ("," if s + 1 < len(sets) else ""))
        parts.append("\n}" + ("," if t + 1 < len(templates) else ""))
    parts.append("\n}}\n")
    path.write_text("".join(parts), encoding="utf-8")
    assert json.loads(path.read_text(encoding="utf-8"))["templates"] == templates


def build(out: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer
    build_tokenizer(out / "tokenizer")
    (out / "templates").mkdir(parents=True, exist_ok=True)
    for name, template in TEMPLATES.items():
        (out / "templates" / f"{name}.jinja").write_text(template, encoding="utf-8")
    records = conversations()
    assert all(r["messages"][-1]["role"] == "assistant" for r in records)
    exchanges = [{"prompt": p, "completion": c} for p, c in EXCHANGES]
    write_jsonl(out / "conversations.jsonl", records)
    write_jsonl(out / "exchanges.jsonl", exchanges)
    # what the tests read is what the references are made from
    records = [json.loads(line) for line in (out / "conversations.jsonl").read_text(encoding="utf-8").splitlines()]
    exchanges = [json.loads(line) for line in (out / "exchanges.jsonl").read_text(encoding="utf-8").splitlines()]
    tok = AutoTokenizer.from_pretrained(out / "tokenizer")
    assert tok.chat_template == CHATML_GEN and tok.eos_token == "<|endoftext|>" and tok.bos_token is None
    raw = Tokenizer.from_file(str(out / "tokenizer" / "tokenizer.json"))
    print(f"{len(records)} conversations, {len(exchanges)} exchanges")
    templates = reference(tok, raw, records, exchanges)
    write_reference(out / "reference.json", templates)
    lengths = {name: [len(e["ids"]) for e in sets["conversations"]] for name, sets in templates.items()}
    print(f"conversation lengths (chatml): {lengths['chatml']}")
    print(f"conversations of >= 400 tokens: {[sum(n >= 400 for n in v) for v in lengths.values()]}")
    for name in TEMPLATES:
        show_masked(tok, name, templates[name]["conversations"][3])


# ----------------------------------------------------------------------------------------------- --check-export

def check_export(folder: Path, conversations_file: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(folder)
    template = tok.chat_template
    if not isinstance(template, str) or not template:
        raise SystemExit(f"check-export: {folder} has no chat template (got {type(template).__name__})")
    record = json.loads(conversations_file.read_text(encoding="utf-8").splitlines()[0])
    messages = record["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    enc = tok.apply_chat_template(messages[:last], tools=record.get("tools"), add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad():
        out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], max_new_tokens=8,
                             do_sample=False, pad_token_id=pad)
    n = enc["input_ids"].shape[-1]
    new = out[0, n:].tolist()
    print(f"prompt {n} tokens; template {template[:40]!r}; {len(new)} new tokens {tok.decode(new)!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help="the fixture folder (written, or read by --check-export)")
    ap.add_argument("--check-export", type=Path, metavar="DIR", help="check an exported Hugging Face folder instead")
    args = ap.parse_args()
    pin_date()
    if args.check_export is None:
        build(args.out)
        return
    try:
        check_export(args.check_export, args.out / "conversations.jsonl")
    except Exception as e:  # one line, whatever failed
        first = (str(e).strip().splitlines() or [""])[0]
        sys.exit(f"check-export failed: {type(e).__name__}: {first}")


if __name__ == "__main__":
    main()
