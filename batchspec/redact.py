"""Secrets never leave the process: sanitised URLs, scrubbed messages and an allow-listed view of
the job spec for everything that is persisted or logged.

One home for everything about secrets:

- :func:`sanitize_url` drops ``user:password@``, query strings and fragments from a URL.
- :func:`public_spec` is the view of a resolved spec mapping that may be written anywhere (run
  summary, manifests, Parquet metadata, events, status, reports).
- :func:`secret_values` lists what :func:`public_spec` hid, so that :func:`scrub_text` can take
  those values out of free text (exception and event messages) that quotes them.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
from collections.abc import Iterable
from typing import Any
from urllib.parse import parse_qsl, unquote

REDACTED = "***"

#: Shortest secret :func:`scrub_text` replaces: shorter values would garble ordinary words.
MIN_SECRET_CHARS = 4

# ----------------------------------------------------------------------------------- URLs

_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*://"
#: ``scheme://userinfo@``: the userinfo runs to the last ``@`` before the first ``/``, ``?`` or
#: ``#`` (greedy), so a password that contains ``@`` is dropped whole.
_USERINFO = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^/?#\s]*)@")
#: ``scheme://user:pass/word@``: AWS secret keys hold raw ``/``, and people paste them as is.
_USERINFO_SLASH = re.compile(rf"(?P<scheme>{_SCHEME})(?P<userinfo>[^/?#\s:@]*:[^?#\s]*)@")
#: Schemes whose authority may be ``host:port``; ``host:8080/data@v2`` is then a path, not a login.
_PORT_SCHEMES = frozenset(
    {"http", "https", "ws", "wss", "ftp", "sftp", "ssh", "hdfs", "webhdfs", "smb", "redis", "rediss"}
)
#: A ``?`` or ``#`` followed by ``name=``: a query (or fragment) even where ``?`` could be a glob.
_KEY_VALUE_START = re.compile(r"[?#][A-Za-z0-9_.~%+\-]+=")
#: A URL inside free text: from its scheme to the next blank or quote.
_URL_IN_TEXT = re.compile(rf"{_SCHEME}[^\s'\"<>`]*")
#: Schemes whose ``?`` and ``#`` always start a query or fragment (fsspec's HTTP glob ignores ``?``).
_HTTP_SCHEMES = frozenset({"http", "https", "ws", "wss", "webhdfs", "ftp", "sftp"})
#: Azure URLs write ``container@account``: that ``@`` is not userinfo unless it holds a ``:``.
_AZURE_SCHEMES = frozenset({"az", "abfs", "abfss", "adl", "wasb", "wasbs"})


def _query_start(url: str, scheme: str, after: int) -> int:
    """Index where the query string or fragment starts, or -1."""
    if scheme in _HTTP_SCHEMES:
        starts = [i for i in (url.find("?", after), url.find("#", after)) if i >= 0]
        return min(starts) if starts else -1
    # Elsewhere ``?`` is also fsspec's one-character wildcard (``part-?.parquet``): only a ``?``
    # or ``#`` followed by ``name=`` starts a query, as in ``?versionId=3`` or ``?sv=...&sig=...``.
    m = _KEY_VALUE_START.search(url, after)
    return m.start() if m else -1


def _userinfos(url: str) -> list[tuple[int, int, str]]:
    """(start, end, userinfo) of each ``user:pass@`` in ``url``; start..end is what to drop."""
    found = []
    for m in _USERINFO.finditer(url):
        if m["scheme"][:-3].lower() in _AZURE_SCHEMES and ":" not in m["userinfo"]:
            continue  # container@account
        found.append((m.end("scheme"), m.end(), m["userinfo"]))
    for m in _USERINFO_SLASH.finditer(url):
        if any(start < m.end() and m.end("scheme") < end for start, end, _ in found):
            continue  # overlaps a plain ``user:pass@`` already found
        scheme = m["scheme"][:-3].lower()
        if scheme in _PORT_SCHEMES and re.match(r"[^:]*:\d+(?:/|$)", m["userinfo"]):
            continue  # host:port/path@...
        found.append((m.end("scheme"), m.end(), m["userinfo"]))
    return sorted(found)


def sanitize_url(url: str) -> str:
    """``url`` without userinfo (``user:pass@``), query string or fragment; scheme, host and path
    are kept. Plain local paths come back unchanged, and globs keep their wildcards."""
    first = re.search(_SCHEME, url)
    if first is None:
        return url
    cut = _query_start(url, first.group(0)[:-3].lower(), first.end())
    if cut >= 0:
        url = url[:cut]
    # Every ``scheme://`` in it counts, for chained fsspec URLs such as ``simplecache::s3://...``.
    for start, end, _ in reversed(_userinfos(url)):
        url = url[:start] + url[end:]
    return url


def _url_secrets(text: str) -> set[str]:
    """The parts :func:`sanitize_url` drops from every URL in ``text``: userinfo, query values."""
    found: set[str] = set()
    for token in _URL_IN_TEXT.findall(text):
        first = re.search(_SCHEME, token)
        cut = _query_start(token, first.group(0)[:-3].lower(), first.end())
        if cut >= 0:
            query = token[cut + 1 :]
            found.add(query)
            for part in re.split(r"[#&;]", query):
                found.add(part.partition("=")[2])
            for _, value in parse_qsl(query.replace("#", "&"), keep_blank_values=True):
                found.add(value)
            token = token[:cut]
        for _, _, userinfo in _userinfos(token):
            user, _, password = userinfo.partition(":")
            found.update({userinfo, user, password, unquote(password)})
    return {s for s in found if s}


# ----------------------------------------------------------------------------------- free text


@functools.lru_cache(maxsize=64)
def _secrets_pattern(secrets: frozenset[str]) -> re.Pattern | None:
    if not secrets:
        return None
    # Longest first, so that a secret containing a shorter one is replaced whole.
    ordered = sorted(secrets, key=lambda s: (-len(s), s))
    return re.compile("|".join(re.escape(s) for s in ordered))


def scrub_text(text: str, secrets: Iterable[str] = ()) -> str:
    """Free text (an error or event message) with every given secret value of at least
    :data:`MIN_SECRET_CHARS` characters replaced by ``***`` and every URL in it sanitised."""
    if not text:
        return text
    wanted = frozenset(s for s in secrets if isinstance(s, str) and len(s) >= MIN_SECRET_CHARS)
    pattern = _secrets_pattern(wanted)
    if pattern is not None:
        text = pattern.sub(REDACTED, text)
    if "://" in text:
        text = _URL_IN_TEXT.sub(lambda m: sanitize_url(m.group(0)), text)
    return text


# ----------------------------------------------------------------------------------- key names

#: Words that make a key a credential wherever they appear in its name.
_SECRET_WORDS = frozenset(
    {
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "secret",
        "secrets",
        "authorization",
        "auth",
        "credential",
        "credentials",
        "creds",
        "cred",
        "sas",
        "signature",
        "sig",
        "cookie",
        "cookies",
        "apikey",
        "bearer",
        "dsn",
        "jwt",
        "otp",
    }
)
#: Substrings of a key with its separators removed (``X-Api-Key`` -> ``xapikey``).
_SECRET_COMPACT = (
    "password",
    "passwd",
    "passphrase",
    "secret",
    "apikey",
    "accesskey",
    "privatekey",
    "accountkey",
    "authorization",
    "credential",
    "connectionstring",
    "connstr",
    "sastoken",
    "accesstoken",
    "authtoken",
    "refreshtoken",
    "sessiontoken",
    "hftoken",
    "bearer",
    "signature",
)
#: ``<word>_token`` names that are vocabulary entries, not credentials (``eos_token``).
_VOCAB_TOKEN_WORDS = frozenset(
    {
        "bos",
        "eos",
        "pad",
        "unk",
        "sep",
        "cls",
        "mask",
        "special",
        "start",
        "end",
        "stop",
        "image",
        "video",
        "audio",
    }
)


def _words(key: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key)
    return [w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if w]


def is_secret_key(key: Any) -> bool:
    """Whether a mapping key names a credential (``token``, ``hf_token``, ``api_key``,
    ``password``, ``Authorization``, ``connection_string``, ``sas_token``, ...)."""
    if not isinstance(key, str):
        return False
    words = _words(key)
    if not words:
        return False
    compact = "".join(words)
    if any(part in compact for part in _SECRET_COMPACT) or _SECRET_WORDS.intersection(words):
        return True
    if "connection" in words or "private" in words:
        return True
    last = words[-1]
    before = words[-2] if len(words) > 1 else ""
    if last == "token" and before not in _VOCAB_TOKEN_WORDS:
        return True  # token, hf_token, id_token; not max_tokens, not eos_token
    if last == "key" or (last == "id" and before == "key"):
        return True  # key, api_key, access_key, aws_access_key_id
    return False


# ----------------------------------------------------------------------------------- the spec

#: String-valued ``model.engine`` keys (vLLM EngineArgs fields) whose values are not secrets:
#: names of dtypes, backends, revisions, tokenizers. Any other string under ``model.engine`` is
#: hidden, so an engine argument vLLM adds later is hidden until it is listed here.
ENGINE_STRING_KEYS = frozenset(
    {
        "dtype",
        "tokenizer",
        "tokenizer_mode",
        "revision",
        "tokenizer_revision",
        "code_revision",
        "quantization",
        "load_format",
        "kv_cache_dtype",
        "config_format",
        "generation_config",
        "model_impl",
        "runner",
        "convert",
        "task",
        "served_model_name",
        "download_dir",
        "hf_config_path",
        "distributed_executor_backend",
        "logprobs_mode",
        "reasoning_parser",
        "attention_backend",
        "mamba_cache_dtype",
        "mamba_ssm_cache_dtype",
        "mamba_cache_mode",
        "performance_mode",
        "scheduling_policy",
        "prefix_caching_hash_algo",
        "data_parallel_backend",
        "all2all_backend",
        "moe_backend",
        "linear_backend",
        "optimization_level",
        "per_request_spec_decode_metrics",
        "log_level",
        "lora_dtype",
        "mm_encoder_tp_mode",
        "mm_processor_cache_type",
        "safetensors_load_strategy",
        "pt_load_map_location",
        "kv_offloading_backend",
        "offload_backend",
        "expert_placement_strategy",
        "device",
        "guided_decoding_backend",
        "tool_call_parser",
    }
)


def public_spec(raw: dict) -> dict:
    """An allow-listed copy of a resolved spec mapping, safe to persist or log.

    The rule, applied to every mapping at any depth:

    1. Every value under a ``storage_options`` key is ``***``; its keys (and the keys of mappings
       nested in it) are kept, so a reader still sees which options were set.
    2. A key that names a credential (:func:`is_secret_key`: ``token``, ``hf_token``,
       ``api_key``, ``password``, ``passphrase``, ``secret``, ``Authorization``,
       ``credential``, ``sas_token``, ``signature``, ``connection_string``, ``private_key``,
       ...) has its whole value replaced by ``***``.
    3. Directly under ``model.engine`` (vLLM engine arguments) numbers, booleans and null are
       kept; a string is kept only for a key in :data:`ENGINE_STRING_KEYS`, otherwise it is
       ``***``. Mappings and lists there are walked with these same rules.
    4. Every URL in every string that is kept is sanitised (:func:`sanitize_url`: no userinfo,
       no query string, no fragment); local paths are unchanged. Values YAML builds that JSON
       lacks (dates) become strings, bytes become ``***``.
    """
    return _public_mapping(raw, ())


def secret_values(raw: dict) -> set[str]:
    """The string values :func:`public_spec` hides (whole values, URL userinfo and passwords,
    query strings and their values), for :func:`scrub_text` to take out of free text."""
    found: set[str] = set()
    _collect(raw, (), False, found)
    return {s for s in found if s and s != REDACTED}


def _public_mapping(value: dict, path: tuple) -> dict:
    out = {}
    for key, item in value.items():
        here = (*path, key)
        if key == "storage_options":
            out[key] = _mask_leaves(item)
        elif is_secret_key(key):
            out[key] = REDACTED
        elif path == ("model", "engine") and isinstance(item, str | bytes) and key not in ENGINE_STRING_KEYS:
            out[key] = REDACTED
        else:
            out[key] = _public_value(item, here)
    return out


def _public_value(value: Any, path: tuple) -> Any:
    if isinstance(value, dict):
        return _public_mapping(value, path)
    if isinstance(value, list | tuple | set | frozenset):
        return [_public_value(v, path) for v in value]
    if isinstance(value, str):
        return scrub_text(value) if "://" in value else value
    if value is None or isinstance(value, bool | int | float):
        return value
    if isinstance(value, dt.date | dt.time):
        return value.isoformat()
    return REDACTED  # bytes (!!binary) or anything else we cannot vouch for


def _mask_leaves(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _mask_leaves(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_leaves(v) for v in value]
    return REDACTED


def _collect(value: Any, path: tuple, hidden: bool, found: set[str]) -> None:
    """Add to ``found`` every string public_spec hides; ``hidden``: the whole value is hidden."""
    if isinstance(value, dict):
        for key, item in value.items():
            hide = (
                hidden
                or key == "storage_options"
                or is_secret_key(key)
                or (path == ("model", "engine") and isinstance(item, str) and key not in ENGINE_STRING_KEYS)
            )
            _collect(item, (*path, key), hide, found)
        return
    if isinstance(value, list | tuple | set | frozenset):
        for item in value:
            _collect(item, path, hidden, found)
        return
    if isinstance(value, str):
        if hidden:
            found.add(value)
        found.update(_url_secrets(value))
    elif (
        hidden
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and path
        and is_secret_key(path[-1])
    ):
        found.add(str(value))  # a numeric PIN or key under a credential name


# ----------------------------------------------------------------------------------- written specs
#
# A spec batchspec writes for a user to keep and run again (``tune --write``) is the YAML as the
# user wrote it, ``${VAR}`` not expanded. It may hold a credential only as a reference to the
# environment; :func:`literal_secrets` finds every place where it holds one literally.

#: ``${NAME}`` or ``${NAME:-default}``, as the job spec expands them (:mod:`batchspec.spec.load`).
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
#: What may stand beside references in a credential's value: one scheme word (``Bearer ${T}``).
_AUTH_SCHEME = re.compile(r"\s*(?:[A-Za-z][A-Za-z0-9-]*\s+)?")
#: gcsfs ``token`` values that name a way to log in, not a credential (``token: anon``).
GCSFS_TOKEN_MODES = frozenset({"anon", "google_default", "cloud", "browser", "cache"})
#: Schemes where a bare ``name@`` is itself a token (``https://ghp_...@host``), not a login name.
_TOKEN_USER_SCHEMES = frozenset({"http", "https", "ws", "wss"})


def is_env_reference(value: Any) -> bool:
    """Whether a string, as written in a job file, takes its secret from the environment: one
    or more ``${VAR}`` with no default (or an empty one), and beside them at most a leading
    scheme word (``Bearer ${TOKEN}``). ``${TOKEN:-hf_abc}`` is not: its default is literal."""
    if not isinstance(value, str):
        return False
    refs = list(_ENV_REF.finditer(value))
    if not refs or any(m.group(2) for m in refs):
        return False
    return _AUTH_SCHEME.fullmatch(_ENV_REF.sub("", value)) is not None


def url_literal_secrets(text: str) -> list[str]:
    """The credentials written literally in the URLs of ``text``, each said in words: a
    ``user:password@`` password, a bare ``token@`` on HTTP(S), a query parameter whose name is a
    credential's (``sig=``, ``X-Amz-Signature=``, ``token=``, ...). A ``${VAR}`` in their place
    is not literal; a query parameter such as ``versionId=3`` is not a credential."""
    found: list[str] = []
    if "://" not in text:
        return found
    for token in _URL_IN_TEXT.findall(text):
        first = re.search(_SCHEME, token)
        scheme = first.group(0)[:-3].lower()
        cut = _query_start(token, scheme, first.end())
        if cut >= 0:
            for part in re.split(r"[#&;]", token[cut + 1 :]):
                name, _, value = part.partition("=")
                if value and is_secret_key(unquote(name)) and not is_env_reference(unquote(value)):
                    found.append(f"the URL's query parameter {unquote(name)}=")
            token = token[:cut]
        for _, _, userinfo in _userinfos(token):
            user, sep, password = userinfo.partition(":")
            if sep and password and not is_env_reference(unquote(password)):
                found.append("the password in the URL's user:password@")
            elif not sep and scheme in _TOKEN_USER_SCHEMES and not is_env_reference(unquote(user)):
                found.append("the token in the URL's token@")
    return found


def literal_secrets(raw: Any) -> list[str]:
    """Where a spec mapping *as written* (``${VAR}`` not expanded) holds a credential literally,
    as ``dotted.key`` (with what it is, for URLs); empty when it may be written to a file.

    A credential is the value of a key :func:`is_secret_key` names (``hf_token``, ``api_key``,
    ``password``, ``Authorization``, and inside ``storage_options`` ``key``, ``secret``,
    ``token``, ``account_key``, ``sas_token``, ``connection_string``, ... at any depth), or a
    URL's password, HTTP(S) ``token@`` or credential query parameter (``sig=``). It is literal
    unless it is a ``${VAR}`` (:func:`is_env_reference`); null, booleans, empty strings and
    gcsfs's ``token`` modes (``anon``, ``google_default``, ...) are not credentials. Other
    ``storage_options`` values (``endpoint_url``, ``region_name``, ``anon``) and other strings
    are configuration: only the URLs in them are checked."""
    found: list[str] = []
    _find_literals(raw, (), False, found)
    return found


def _dotted(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _find_literals(value: Any, path: tuple, secret: bool, found: list[str]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _find_literals(item, (*path, key), secret or is_secret_key(key), found)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _find_literals(item, (*path, i), secret, found)
    elif secret:
        if value is None or isinstance(value, bool) or value == "" or is_env_reference(value):
            return
        last = next((p for p in reversed(path) if isinstance(p, str)), "")
        if last == "token" and value in GCSFS_TOKEN_MODES:
            return
        found.append(_dotted(path))
    elif isinstance(value, str):
        found.extend(f"{_dotted(path)} ({what})" for what in url_literal_secrets(value))
