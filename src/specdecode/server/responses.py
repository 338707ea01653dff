"""OpenAI response pieces: errors, logprobs in the chat and the completions formats, and usage."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse

from ..sampling import TokenLogprob

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {
        "error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"), "param": param, "code": status}
    }


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status)


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a banned token's logprob is reported as this


def _finite(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_texts(tokenizer, as_ids: bool) -> Callable[[int], str]:
    """How a logprob entry names its token: its text, or with vLLM's return_tokens_as_token_ids "token_id:ID" (a
    token that is part of a character, or one that decodes to nothing, named all the same)."""
    if as_ids:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


def chat_logprobs(token_text: Callable[[int], str], logprobs: list[TokenLogprob]) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(token_id)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode())}

    return {
        "content": [
            entry(lp.token_id, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]} for lp in logprobs
        ]
    }


def completion_logprobs(
    token_text: Callable[[int], str],
    logprobs: list[TokenLogprob | None],
    text_offset: int = 0,
    token_ids: list[int] | None = None,
) -> dict:
    """token_ids: the tokens, where an entry of logprobs is None (an echoed prompt's first token)."""
    ids = [lp.token_id if lp is not None else token_ids[i] for i, lp in enumerate(logprobs)]
    tokens = [token_text(token) for token in ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else _finite(lp.logprob) for lp in logprobs],
        "top_logprobs": [None if lp is None else {token_text(i): _finite(v) for i, v in lp.top} for lp in logprobs],
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(tokenizer, ids: list[int], scored: list[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) its logprob, rank and text, and those of the
    most likely tokens there, keyed by token id."""

    def entry(logprob: float, rank: int | None, token_id: int) -> dict:
        return {"logprob": _finite(logprob), "rank": rank, "decoded_token": tokenizer.decode([token_id])}

    return [
        None
        if lp is None
        else {str(i): entry(v, rank, i) for rank, (i, v) in enumerate(lp.top, 1)}
        | {str(token): entry(lp.logprob, lp.rank, token)}
        for token, lp in zip(ids, scored)
    ]


def usage(prompt_tokens: int, finals: dict) -> dict:
    """Token counts over all n outputs (their final Updates by index), with the prompt tokens found in the
    KV cache (OpenAI's `prompt_tokens_details.cached_tokens`); the speculation figures are the first
    output's."""
    completion = sum(update.num_tokens for update in finals.values())
    first = finals.get(0)
    spec = (first.spec if first else None) or {}
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": spec.get("num_cached_prompt_tokens", 0)},
        "speculation": spec,
    }
    if first is not None and first.replica is not None:
        out["replica"] = first.replica
    return out
