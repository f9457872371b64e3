"""Incremental detokenization and stop strings: the one implementation, engine and gateway alike.

Text is what ``tokenizer.decode(output_ids, skip_special_tokens=...)`` would give, built one
token at a time (tokenizers' DecodeStream holds back incomplete UTF-8 sequences). Stop strings
are matched on the text; the match and everything after it is cut (kept when
include_stop_str_in_output). While unfinished, ``emittable`` stops short of a possible partial
stop string at the end, so a streaming client never receives text that later turns out to be
the start of a stop string.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False,
                 skip_special_tokens: bool = True):
        # transformers' fast tokenizers wrap a tokenizers.Tokenizer; DecodeStream needs the latter.
        self._backend = getattr(tokenizer, "_tokenizer", tokenizer)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._hold_back = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stop_hit: str | None = None

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one token's text; returns the stop string if this token completed one.

        check_stop=False (before min_tokens) appends without matching stop strings.
        """
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return None
        start = max(0, len(self.text) - self._hold_back)
        self.text += chunk
        if not check_stop:
            return None
        hits = [(i, stop) for stop in self._stop if (i := self.text.find(stop, start)) >= 0]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self._include_stop else index]
        self.stop_hit = stop
        return stop

    def emittable(self, finished: bool) -> int:
        """How much of text is safe to stream now."""
        if finished or not self._stop:
            return len(self.text)
        return max(0, len(self.text) - self._hold_back)
