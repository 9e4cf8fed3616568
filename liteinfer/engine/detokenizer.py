"""Incremental detokenization and stop-string detection for one generated sequence."""

from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

if TYPE_CHECKING:  # transformers is slow to import and only needed for the annotation
    from transformers import PreTrainedTokenizerBase

# How many prompt ids prime the decode stream. A few are enough for the decoder to see the context
# that decides the first output token's leading space.
PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas that are safe to stream, and watches for stop strings.

    `text` is all output text decoded so far (cut at the stop string once one is found). It can run
    ahead of the concatenated deltas by a held-back tail that might be the start of a stop string;
    `flush()` releases that tail when the sequence ends for another reason (length, EOS).
    """

    def __init__(
        self,
        tokenizer: "PreTrainedTokenizerBase",
        prompt_token_ids: list[int],
        skip_special_tokens: bool,
        stop: list[str],
        include_stop_str_in_output: bool,
        min_tokens: int = 0,
    ):
        self.backend = tokenizer.backend_tokenizer
        # Prime with the prompt's tail so the first token decodes as it does inside the full text. For
        # SentencePiece (Metaspace) tokenizers this keeps its leading space (" Hello" where
        # tokenizer.decode(output_ids) would give "Hello"), as vLLM does; for byte-level BPE the two agree.
        context = prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        # A prompt ending inside a multi-byte character would make the stream's first chunk repeat the
        # prompt's text; leave those bytes out so the output decodes like the output ids on their own.
        while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens)[-1:] == "\ufffd":
            context = context[:-1]
        self.stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in stop if s]
        self.max_stop_len = max(map(len, self.stop), default=0)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.text = ""
        self.stop_reason: str | None = None
        self.num_sent = 0  # characters of `text` already returned as deltas
        # As in vLLM, the text of the first min_tokens tokens is not searched for stop strings.
        self.min_tokens = min_tokens
        self.num_tokens = 0

    def step(self, token_ids: list[int]) -> str:
        """Feeds newly generated ids; returns the new text that is safe to show (may be "")."""
        assert self.stop_reason is None, "sequence already stopped"
        old_len = search_from = len(self.text)
        for token_id in token_ids:
            # None means the token ends inside a multi-byte character: the stream keeps it until complete.
            chunk = self.stream.step(self.backend, token_id)
            if chunk:
                self.text += chunk
            self.num_tokens += 1
            if self.num_tokens <= self.min_tokens:
                search_from = len(self.text)
        if len(self.text) == old_len:
            return ""
        if self._find_stop(search_from) or self.include_stop_str_in_output:
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._partial_stop_len())

    def committed_text_from(self, start: int) -> str:
        """The text returned as deltas so far, from character `start` on: no later token can change it, so it only
        ever grows (`text` may still lose a tail that turns out to begin a stop string)."""
        return self.text[start : self.num_sent]

    def flush(self) -> str:
        """Returns the held-back tail once the sequence has finished for a reason other than a stop string."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        delta = self.text[self.num_sent : end]
        self.num_sent = end
        return delta

    def _find_stop(self, old_len: int) -> bool:
        # A stop string may begin in earlier text and end in the new chunk, so the search for `s` starts up to
        # len(s) - 1 characters back. A match that ends wholly in earlier text was found before (or was in the
        # first min_tokens tokens' text, where no stop may be found).
        found = [
            (i, order, s)
            for order, s in enumerate(self.stop)
            if (i := self.text.find(s, max(0, old_len - len(s) + 1))) >= 0
        ]
        if not found:
            return False
        index, _, stop = min(found)  # the earliest match ends generation; ties go to the first listed
        self.stop_reason = stop
        self.text = self.text[: index + len(stop) if self.include_stop_str_in_output else index]
        return True

    def _partial_stop_len(self) -> int:
        # Length of the longest tail of `text` that some stop string starts with: a stop match found
        # later can only begin inside it, so everything before it is final.
        for n in range(min(self.max_stop_len - 1, len(self.text)), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
