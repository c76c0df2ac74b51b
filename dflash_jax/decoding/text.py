"""The text of a completion as its tokens arrive: incremental detokenization cut at stop strings.

Sits beside the loop's token output for every front end that shows text while decoding: ``generate``
(``cli/generate.py``) prints it, the server (``serve/app.py``) sends it as response chunks.
"""

from __future__ import annotations


class TextStream:
    """The text of a completion as its tokens arrive, decoded incrementally, cut at the first stop string.

    Each token decodes only the tokens since the last complete character (and the run before them, so a
    tokenizer that strips a leading space strips it on both decodes alike), never the whole list: O(n)
    decoding over a completion, not O(n^2). A decode ending in U+FFFD (a multi-byte character split over
    tokens) waits for the next token (a stop string in front of it is found at once). ``text`` is
    ``tokenizer.decode(tokens)`` (special tokens skipped, no clean-up of spaces, which could rewrite
    text already shown) up to a held-back incomplete character; ``text[:settled]`` is the part no later
    token can change (the last ``len(longest stop) - 1`` characters may still turn out to start a stop
    string).
    """

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string occurred: ``tokens`` end with the one completing it
        self.ended = False  # ``finish`` was called
        self._start = self._done = 0  # decode window [start, ...); tokens[:done] are in ``text``
        self._held = max((len(s) for s in stops), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _take(self, final: bool) -> str:
        """Appends the window's new characters unless they end in an incomplete one (``final``: anyway);
        returns the complete characters still waiting in front of an incomplete one."""
        before = self._decode(self.tokens[self._start:self._done])
        new = self._decode(self.tokens[self._start:])[len(before):]
        if final or not new.endswith("\ufffd"):
            if new:
                self.text += new
                self._start, self._done = self._done, len(self.tokens)
            return ""
        return new.rstrip("\ufffd")

    def extend(self, tokens) -> None:
        """Adds tokens (ignored once stopped), one at a time so a stop ends at the token completing it."""
        for token in tokens:
            if self.stopped:
                return
            self.tokens.append(int(token))
            old = len(self.text)
            waiting = self._take(final=False)  # a token may complete a stop and start a character
            seen = self.text + waiting
            if self.stops and len(seen) > old:
                tail = max(0, old - self._held)  # a stop can only end in the new characters
                hits = [i for i in (seen.find(s, tail) for s in self.stops) if i >= 0]
                if hits:
                    self.text, self.stopped = seen[:min(hits)], True

    def finish(self) -> None:
        """The stream ended: a held-back incomplete character is added as the decoder shows it."""
        if not self.stopped:
            self._take(final=True)
        self.ended = True

    @property
    def settled(self) -> int:
        return len(self.text) if self.stopped or self.ended else max(0, len(self.text) - self._held)
