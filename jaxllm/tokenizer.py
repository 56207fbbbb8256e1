"""Tokenizer (from a HF folder or a GGUF's ``tokenizer.ggml.*``, as llama.cpp), chat templates in HF's jinja2
sandbox, and the incremental detokenizer (vLLM/TGI's)."""

import functools
import json
import os
import pathlib
import warnings
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from jaxllm.paths import eos_token_ids

# llama.cpp token types (`tokenizer.ggml.token_type`).
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4

# Split regexes for llama.cpp's `tokenizer.ggml.pre` names (from the models' own tokenizer.json).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLIT_REGEX_PRE = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
                    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT}
# These split every digit on its own, then apply the GPT-2 regex (llama.cpp groups them so).
_DIGITS_THEN_GPT2_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GPT2_PRE = {"default", "gpt2", "gpt-2"}


# Variables the renderer gives the chat template itself; chat_template_kwargs may not set them.
TEMPLATE_VARIABLES = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token")


class ChatInputError(ValueError):
    """A conversation the chat template cannot be given; ``field`` names the input at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Tokenizer:
    """A text tokenizer with the special-token ids and chat template a model needs.

    Attributes:
        backend: the wrapped ``tokenizers.Tokenizer``, not changed after construction. bos_token_id: int or None.
        eos_token_ids: list[int], every id that ends generation (the first is ``eos_token_id``).
        chat_template: jinja2 source or None. config: ``tokenizer_config.json`` (empty for a GGUF).
        vocab_size: ids the tokenizer can produce, added tokens included (may be below the model's padded
        embedding rows). source: the folder or ``.gguf`` file it was read from (None when built otherwise), which
        the engine core reads it from too.
    """

    source: pathlib.Path | None = None

    def __init__(self, backend: _Backend, *, bos_token_id: int | None, eos_token_ids: list[int],
                 chat_template: str | None, config: dict | None = None):
        self.backend = backend
        self.config = dict(config or {})
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        # Read once: tokenizers 0.22 rebuilds the whole vocabulary on each get_vocab_size / added-tokens read, and
        # decode checks every id against it.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._special_added_ids = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a Hugging Face model folder, as transformers 5 does (BOS/EOS from the tokenizer, generation
        and model configs).

        Raises:
            ValueError: ``path`` is not a folder with a ``tokenizer.json``.
        """
        folder = pathlib.Path(path)
        if not (folder / "tokenizer.json").is_file():
            raise ValueError(f"{str(path)!r} is not a folder with a tokenizer.json")
        tok_config = _read_json(folder / "tokenizer_config.json")
        backend = _backend_from_json((folder / "tokenizer.json").read_text(encoding="utf-8"), tok_config)
        gen_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        bos_id = _token_id(backend, tok_config.get("bos_token"))
        for cfg in (gen_config, model_config):
            bos_id = cfg.get("bos_token_id") if bos_id is None else bos_id
        eos_ids = [_token_id(backend, tok_config.get("eos_token")), *eos_token_ids(gen_config, model_config)]

        template_file = folder / "chat_template.jinja"
        if template_file.is_file():
            template = template_file.read_text(encoding="utf-8")
        else:
            template = _default_template(tok_config.get("chat_template"))
        tokenizer = cls(backend, bos_token_id=bos_id, eos_token_ids=[i for i in eos_ids if i is not None],
                        chat_template=template, config=tok_config)
        tokenizer.source = folder
        return tokenizer

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build from a GGUF file's ``tokenizer.ggml.*`` metadata, following llama.cpp ("gpt2" or "llama").

        Raises:
            ValueError: the file has no tokenizer, or its model is neither "gpt2" nor "llama".
        """
        from jaxllm.loader.gguf import gguf_tokenizer_metadata  # the loader package imports JAX

        meta = gguf_tokenizer_metadata(path)
        kind = meta.get("model")
        if kind == "gpt2":
            backend = _byte_level_bpe(meta)
        elif kind == "llama":
            backend = _sentencepiece_bpe(meta)
        else:
            raise ValueError(f"{os.fspath(path)}: unsupported GGUF tokenizer model {kind!r}; "
                             f"supported: 'gpt2', 'llama'")
        _add_gguf_special_tokens(backend, meta)
        bos_id, eos_id = meta.get("bos_token_id"), meta.get("eos_token_id")
        backend.post_processor = _bos_eos_processor(
            backend, bos_id if meta.get("add_bos_token", kind == "llama") else None,
            eos_id if meta.get("add_eos_token", False) else None)
        tokenizer = cls(backend, bos_token_id=bos_id, eos_token_ids=[] if eos_id is None else [eos_id],
                        chat_template=meta.get("chat_template"))
        tokenizer.source = pathlib.Path(path)
        return tokenizer

    @property
    def eos_token_id(self) -> int | None:
        """The primary EOS id (first of `eos_token_ids`), or None."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def all_special_ids(self) -> list[int]:
        """Sorted ids of every special added token, plus BOS and EOS."""
        ids = set(self._special_added_ids)
        ids.update(self.eos_token_ids)
        if self.bos_token_id is not None:
            ids.add(self.bos_token_id)
        return sorted(ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the post-processor's BOS/EOS too. Raises ValueError:
        `text` is not a str."""
        if not isinstance(text, str):
            raise ValueError(f"encode expects a str, got {type(text).__name__}: {text!r:.80}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of a sequence of ids, special tokens dropped when asked. Raises ValueError: an id out of range."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id(s) {bad[:5]} outside [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def set_chat_template(self, source: str) -> None:
        """Use `source` (jinja2) as the chat template from now on. Raises ValueError: not a valid template."""
        self._template = compile_chat_template(source)
        self.chat_template = source

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools=None, continue_final_message: bool = False,
                            chat_template: str | None = None, template_kwargs: dict | None = None) -> str:
        """Render a conversation with the chat template, as HF's ``apply_chat_template(..., tokenize=False)``.

        Args:
            messages: dicts with at least ``role`` and ``content``.
            add_generation_prompt: append the cue for the assistant's turn.
            tools: JSON-schema dicts passed as ``tools``.
            continue_final_message: cut the text right after the last message's content (HF's and vLLM's rule).
            chat_template: a jinja2 template instead of the model's.
            template_kwargs: extra variables (vLLM's ``chat_template_kwargs``); the ones above take precedence.

        Returns the prompt text, with any BOS the template writes (encode with ``add_special_tokens=False``).
        Raises ValueError (no template, malformed ``messages``, both prompt flags, nothing to continue) or
        jinja2.TemplateError.
        """
        template = compile_chat_template(chat_template) if chat_template is not None else self._template
        if template is None:
            raise ValueError("this model has no chat template; format the prompt yourself or give one (--chat-template, "
                             "or chat_template=)")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"messages must be a list of dicts, got {messages!r:.200}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: one continues "
                             "the last message, the other starts a new assistant turn")
        text = template.render({
            **(template_kwargs or {}), "messages": messages, "tools": tools,
            "add_generation_prompt": add_generation_prompt, "bos_token": self._token_text(self.bos_token_id),
            "eos_token": self._token_text(self.eos_token_id)})
        return _cut_after_final_message(text, messages) if continue_final_message else text

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None, chat_template: str | None = None,
                    content_format: str = "auto") -> str:
        """OpenAI-style messages in the chat template (vLLM's rules: tool-call ``arguments`` JSON-decoded; content
        as ``content_format`` says, :data:`CONTENT_FORMATS`); see :meth:`apply_chat_template`. Raises ChatInputError
        naming the bad argument.
        """
        if content_format not in CONTENT_FORMATS:
            raise ChatInputError("chat_template_content_format", f"chat_template_content_format={content_format!r} "
                                 f"must be one of {CONTENT_FORMATS}")
        clash = [k for k in chat_template_kwargs or {} if k in TEMPLATE_VARIABLES]
        if clash:
            raise ChatInputError("chat_template_kwargs", f"chat_template_kwargs may not set {clash}: the renderer "
                                 "sets them (give them as the request's fields or the call's arguments instead)")
        if not isinstance(messages, list):
            raise ChatInputError("messages", f"messages must be a list of message dicts, got {messages!r:.100}")
        if content_format == "auto":
            source = chat_template if chat_template is not None else self.chat_template
            content_format = detect_content_format(source) if source else "string"
        conversation = [_template_message(i, m, content_format == "openai") for i, m in enumerate(messages)]
        try:
            return self.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                            continue_final_message=continue_final_message, tools=tools,
                                            chat_template=chat_template, template_kwargs=chat_template_kwargs)
        except ValueError as e:
            if "continue_final_message" in str(e):
                raise ChatInputError("continue_final_message", str(e)) from None
            if chat_template is None and self._template is None:  # no template to fail: say that alone
                raise ChatInputError("messages", str(e)) from None
            raise ChatInputError("messages", f"the chat template failed on these messages: {e}") from None
        except Exception as e:  # the template's own errors (raise_exception)
            raise ChatInputError("messages", f"the chat template failed on these messages: {e}") from None

    def info(self) -> dict:
        """vLLM's ``GET /tokenizer_info`` body: the tokenizer config, ``tokenizer_class`` and the template."""
        info = {k: _token_content(v) for k, v in self.config.items() if k not in ("vocab_file", "merges_file")}
        info.setdefault("bos_token", self._token_text(self.bos_token_id) or None)
        info.setdefault("eos_token", self._token_text(self.eos_token_id) or None)
        info["tokenizer_class"] = self.config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.chat_template:
            info["chat_template"] = self.chat_template
        return info

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.backend.id_to_token(token_id) or "")


def load_tokenizer(path: str | os.PathLike) -> Tokenizer | None:
    """The tokenizer a model ships (GGUF metadata or a folder's tokenizer.json), or None (token-id prompts only)."""
    path = pathlib.Path(path)
    if path.is_file():
        from jaxllm.loader.gguf import gguf_has_tokenizer  # the loader package imports JAX

        return Tokenizer.from_gguf(path) if gguf_has_tokenizer(path) else None
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(path)
    return None


def load_named_tokenizer(source: str | os.PathLike, revision: str | None = None,
                         download_dir: str | None = None) -> Tokenizer:
    """A tokenizer given as vLLM's ``tokenizer`` option: a folder with a ``tokenizer.json``, a ``.gguf`` file, a
    named model or a Hub id (``jaxllm.named_models.resolve_model``).

    Raises:
      ValueError: nothing there, or no tokenizer in it (named).
    """
    from jaxllm.named_models import resolve_model

    path = resolve_model(str(source), revision, download_dir)
    tokenizer = load_tokenizer(path) if path.exists() else None
    if tokenizer is None:
        where = "no tokenizer in" if path.exists() else "no such file or folder:"
        raise ValueError(f"tokenizer={str(source)!r}: {where} {str(path)!r} (a folder with a tokenizer.json, or a "
                         ".gguf file with one)")
    return tokenizer


class IncrementalDetokenizer:
    """Turns generated ids into text deltas one token at a time (vLLM/TGI's prefix/read offsets); nothing is
    emitted while the tail is a split UTF-8 character. ``text``: ``decode(prompt + output) - decode(prompt)``.

    Args:
        tokenizer: the model's ``Tokenizer``. prompt_token_ids: the prompt's ids. skip_special_tokens: bool.
    """

    _CONTEXT = 5  # prompt tokens kept as context, as vLLM's initial offset

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._window = [int(i) for i in prompt_token_ids[-self._CONTEXT:]]
        self._prefix_offset = 0
        self._read_offset = len(self._window)
        self._prefix_text: str | None = None

    def step(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" while a character is split)."""
        delta = self.peek(token_id)
        self.token_ids.append(int(token_id))
        self._window.append(int(token_id))
        if delta:
            self.text += delta
            # Drop what no later window needs, so each step decodes a bounded number of ids.
            self._window = self._window[self._read_offset:]
            self._prefix_offset, self._read_offset = 0, len(self._window)
            self._prefix_text = None
        return delta

    def peek(self, token_id: int) -> str:
        """The text ``step(token_id)`` would return, leaving the state unchanged (logprob token texts)."""
        decode = self.tokenizer.decode
        if self._prefix_text is None:  # shared by every candidate of one position
            self._prefix_text = decode(self._window[self._prefix_offset:self._read_offset],
                                       self.skip_special_tokens)
        full = decode(self._window[self._prefix_offset:] + [int(token_id)], self.skip_special_tokens)
        if len(full) <= len(self._prefix_text) or full.endswith("\ufffd"):
            return ""
        return full[len(self._prefix_text):]


def _cut_after_final_message(text: str, messages: list[dict]) -> str:
    """`text` up to the end of the last message's content, as HF's `continue_final_message` cuts it.

    Raises:
        ValueError: there is no message, its content is not a string, or it is not in `text`.
    """
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a last message with text content to continue")
    at = text.rfind(final.strip())
    if at < 0:
        raise ValueError("continue_final_message: the chat template does not write the last message's content")
    # A template that strips the content loses its trailing spaces; one that keeps them keeps them here too.
    kept = final.lstrip()
    return text[:at + len(kept)] if text[at:at + len(kept)] == kept else text[:at + len(final.strip())]


def _token_content(value):
    """A setting as transformers' serialised ``init_kwargs`` hold it: an added token dict becomes its text."""
    if isinstance(value, dict):
        return value["content"] if "content" in value else {k: _token_content(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_token_content(v) for v in value]
    return value


# How message content reaches a chat template (vLLM's chat_template_content_format): "string", one string; "openai",
# a list of text parts; "auto", whichever the template reads (detect_content_format).
CONTENT_FORMATS = ("auto", "string", "openai")


@functools.lru_cache(maxsize=16)
def detect_content_format(source: str) -> str:
    """The content format vLLM's "auto" resolves a chat template to: "openai" when the template loops over a
    message's content, else "string" (also for a template jinja2 cannot parse).

    vLLM's rules: a message is a loop variable over ``messages``, or over what a ``{% set %}`` or a
    ``namespace(...)`` field took from it; a loop over its ``m['content']`` or ``m.content`` (through filters,
    tests and slices) counts, as does, inside a macro, a loop over a parameter some call gives a message's content,
    and, outside macros, a loop over a bare ``content``.
    """
    try:
        tree = jinja2.Environment(extensions=[jinja2.ext.loopcontrols]).parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    loops = list(tree.find_all(jinja2.nodes.For))
    lists = _derived(tree, {"messages"})
    messages = {loop.target.name for loop in loops
                if isinstance(loop.target, jinja2.nodes.Name) and _path(loop.iter) in lists}
    in_macros = set()
    for macro in tree.find_all(jinja2.nodes.Macro):
        params = _params_given_content(tree, macro, messages)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name in params:
                return "openai"
    return "openai" if any(_reads_content(loop.iter, messages) or (
        id(loop) not in in_macros and isinstance(loop.iter, jinja2.nodes.Name) and loop.iter.name == "content")
        for loop in loops) else "string"


def _strip(node: jinja2.nodes.Node) -> jinja2.nodes.Node:
    """``node`` without the filters, tests and slices around it (``messages[1:] | list`` -> ``messages``)."""
    while True:
        if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)) and node.node is not None:
            node = node.node
        elif isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
            node = node.node
        else:
            return node


def _path(node: jinja2.nodes.Node) -> str | None:
    """The variable ``node`` reads under filters, tests and slices: "name", "ns.field" (a namespace's), or None."""
    node = _strip(node)
    if isinstance(node, jinja2.nodes.Name):
        return node.name
    if isinstance(node, (jinja2.nodes.Getattr, jinja2.nodes.NSRef)):
        owner = node.node if isinstance(node, jinja2.nodes.Getattr) else node
        name = owner.name if isinstance(owner, (jinja2.nodes.Name, jinja2.nodes.NSRef)) else None
        return None if name is None else f"{name}.{node.attr}"
    return None


def _reads_content(node: jinja2.nodes.Node, messages: set[str]) -> bool:
    """Whether ``node`` is ``m['content']`` or ``m.content`` (under filters, tests, slices) of an ``m`` in
    ``messages``."""
    node = _strip(node)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Const):
        key = node.arg.value
    elif isinstance(node, jinja2.nodes.Getattr):
        key = node.attr
    else:
        return False
    return key == "content" and isinstance(node.node, jinja2.nodes.Name) and node.node.name in messages


def _derived(tree: jinja2.nodes.Template, names: set[str]) -> set[str]:
    """``names`` and every variable a ``{% set %}`` (a name or a namespace field) or a ``namespace(...)`` field
    takes from one of them (under filters, tests and slices), transitively."""
    names = set(names)
    while True:
        more = set()
        for assign in tree.find_all(jinja2.nodes.Assign):
            target, value = _path(assign.target), assign.node
            if target is not None and _path(value) in names:
                more.add(target)
            if (isinstance(assign.target, jinja2.nodes.Name) and isinstance(value, jinja2.nodes.Call)
                    and isinstance(value.node, jinja2.nodes.Name) and value.node.name == "namespace"):
                more |= {f"{assign.target.name}.{kw.key}" for kw in value.kwargs if _path(kw.value) in names}
        more -= names
        if not more:
            return names
        names |= more


def _params_given_content(tree: jinja2.nodes.Template, macro: jinja2.nodes.Macro, messages: set[str]) -> set[str]:
    """The parameters of ``macro`` that some call of it gives a message's content."""
    names = [arg.name for arg in macro.args]
    params = set()
    for call in tree.find_all(jinja2.nodes.Call):
        if isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name:
            params |= {name for name, arg in zip(names, call.args) if _reads_content(arg, messages)}
            params |= {kw.key for kw in call.kwargs if kw.key in names and _reads_content(kw.value, messages)}
    return params


@functools.lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in HF's sandbox with HF's helpers (cached per source).

    Raises:
        ValueError: ``source`` is not valid jinja2.
    """
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid jinja2: {e} (line {e.lineno})") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters, which would change prompts
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)


def _read_json(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _backend_from_json(text: str, tok_config: dict) -> _Backend:
    """The backend of a `tokenizer.json` (its text), with `tokenizer_config.json`'s flags applied."""
    spec = json.loads(text)
    return _Backend.from_str(json.dumps(spec) if _apply_config_flags(spec, tok_config) else text)


def _apply_config_flags(spec: dict, tok_config: dict) -> bool:
    """Apply ``legacy``/``add_prefix_space`` to a parsed tokenizer.json as transformers 5 does; True if changed."""
    cls = tok_config.get("tokenizer_class")
    if cls in (None, "PreTrainedTokenizerFast", "TokenizersBackend"):
        return False
    add_prefix_space = tok_config.get("add_prefix_space")
    if cls in ("LlamaTokenizer", "LlamaTokenizerFast") and _is_sentencepiece(spec):
        prefix = add_prefix_space is not False
        scheme = ("always" if tok_config.get("legacy") else "first") if prefix else "never"
        spec["normalizer"] = None
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": False}
        steps = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                 {"type": "Fuse"}]
        if prefix:
            steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        spec["decoder"] = {"type": "Sequence", "decoders": steps}
        return True
    changed = False
    for p in _components(spec.get("pre_tokenizer"), "pretokenizers"):
        if p["type"] == "ByteLevel" and p.get("add_prefix_space") != bool(add_prefix_space):
            p["add_prefix_space"], changed = bool(add_prefix_space), True
    return changed


def _components(component: dict | None, key: str) -> list[dict]:
    """A tokenizer.json normalizer or pre-tokenizer and, for a `Sequence`, its members (`key`)."""
    if component is None:
        return []
    if component["type"] != "Sequence":
        return [component]
    return [c for member in component[key] for c in _components(member, key)]


def _is_sentencepiece(spec: dict) -> bool:
    """Whether a tokenizer.json marks words SentencePiece's way, with "▁"."""
    return (any(p["type"] == "Metaspace" for p in _components(spec.get("pre_tokenizer"), "pretokenizers"))
            or any(n["type"] == "Replace" and n.get("content") == "▁"
                   for n in _components(spec.get("normalizer"), "normalizers")))


def _token_id(backend: _Backend, token) -> int | None:
    """Id of a token given as a string or as HF's AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _default_template(template) -> str | None:
    """`tokenizer_config.json`'s chat_template: a string, or a list of named ones."""
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default")
    return template


def _byte_level_bpe(meta: dict) -> _Backend:
    vocab = {token: i for i, token in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("merges", [])]
    backend = _Backend(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(meta.get("pre", "default"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_pre_tokenizer(pre: str):
    if pre in _SPLIT_REGEX_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_SPLIT_REGEX_PRE[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_THEN_GPT2_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in _GPT2_PRE:
        warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known to jaxllm; using the GPT-2 "
                      f"split, which may tokenize some text differently from llama.cpp")
    return gpt2


def _sentencepiece_bpe(meta: dict) -> _Backend:
    tokens = meta["tokens"]
    vocab = {token: i for i, token in enumerate(tokens)}
    if "merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    else:
        merges = _merges_from_scores(tokens, meta.get("scores") or [0.0] * len(tokens), vocab)
    unk_id = meta.get("unk_token_id")
    backend = _Backend(models.BPE(vocab, merges, unk_token=None if unk_id is None else tokens[unk_id],
                                  fuse_unk=True, byte_fallback=True))
    prefix = meta.get("add_space_prefix", True)
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="always" if prefix else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float], vocab: dict) -> list[tuple]:
    """SentencePiece BPE merges implied by a scored vocabulary, the merged piece's score highest first."""
    ranked = []
    for token, score in zip(tokens, scores):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-score, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_gguf_special_tokens(backend: _Backend, meta: dict) -> None:
    types = meta.get("token_types") or []
    tokens = meta["tokens"]
    special = [AddedToken(t, special=True, normalized=False)
               for t, kind in zip(tokens, types) if kind in (_CONTROL, _UNKNOWN)]
    user = [AddedToken(t, special=False, normalized=False)
            for t, kind in zip(tokens, types) if kind == _USER_DEFINED]
    backend.add_special_tokens(special)
    backend.add_tokens(user)


def _bos_eos_processor(backend: _Backend, bos_id: int | None, eos_id: int | None):
    """A post-processor that adds BOS and/or EOS around one sequence (and around each of a pair)."""
    bos = [] if bos_id is None else [backend.id_to_token(bos_id)]
    eos = [] if eos_id is None else [backend.id_to_token(eos_id)]
    specials = sorted({(token, backend.token_to_id(token)) for token in bos + eos})
    return processors.TemplateProcessing(single=bos + ["$A"] + eos,
                                         pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
                                         special_tokens=specials)


def read_chat_template(value: str) -> str:
    """A ``--chat-template`` flag's template: the file ``value`` names, else ``value`` when it holds jinja2 (vLLM).

    Raises:
      ValueError: ``value`` names no file and is no template.
    """
    path = pathlib.Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if any(c in value for c in "{}\n"):
        return value
    raise ValueError(f"--chat-template {value}: no such file (and not a template: it has no '{{')")


def _template_message(i: int, message: dict, parts: bool = False) -> dict:
    """A chat message as templates read it: its text content as one string, text parts joined by newlines (vLLM's
    "string" format), or with ``parts`` as a list of ``{"type": "text", "text": ...}`` parts (vLLM's "openai"), but
    a tool result's as one string always, as vLLM's; tool-call ``arguments`` decoded from JSON.

    Raises:
      ChatInputError: ``messages``: malformed message, role, content or tool call.
    """
    if not isinstance(message, dict):
        raise ChatInputError("messages", f"messages[{i}] must be a dict, got {message!r:.100}")
    content = message.get("content")
    if isinstance(content, list):  # OpenAI's content parts: only text is supported
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ChatInputError("messages", f"messages[{i}].content: only parts of type 'text' are supported")
        texts = [str(p.get("text", "")) for p in content]
    elif isinstance(content, str):
        texts = [content]
    elif content is None:
        texts = []
    else:
        texts = None
    if not isinstance(message.get("role"), str) or texts is None:
        raise ChatInputError("messages", f"messages[{i}] needs a string 'role' and a string (or text parts) "
                                         "'content'")
    as_parts = parts and message.get("role") != "tool"
    out = {**message, "content": [{"type": "text", "text": t} for t in texts] if as_parts else "\n".join(texts)}
    if "tool_calls" in message:
        out["tool_calls"] = [_template_call(i, call) for call in message["tool_calls"] or []]
    return out


def _template_call(i: int, call) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ChatInputError("messages", f"messages[{i}].tool_calls: each call needs a function with a name")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            raise ChatInputError("messages", f"messages[{i}].tool_calls: the arguments of {function['name']!r} are "
                                             f"not JSON: {arguments[:100]!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}
