"""Token streams as text: a request's continuation decoded piece by piece, stop strings cut on the host."""

from __future__ import annotations

from collections.abc import Callable, Sequence


class TextStream:
  """A request's continuation as text, piece by piece as tokens come, with stop strings cut.

  Each `push` decodes all tokens so far (a token may change how its neighbours decode) and returns
  the text not yet returned, holding back a trailing U+FFFD (a multi-byte character may be cut)
  and any tail that could be the start of a stop string. Once a stop string appears, the text
  before it is returned and `stopped` is set; the stop string is not returned (as OpenAI does).
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
    self.decode, self.stop = decode, tuple(stop)
    self.ids: list[int] = []
    self.sent = 0
    self.stopped = False

  def push(self, new_ids: Sequence[int], final: bool = False) -> str:
    self.ids += list(new_ids)
    text = self.decode(self.ids)
    found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
    if found:
      self.stopped = True
      end = min(found)
    elif final:
      end = len(text)
    else:
      end = len(text.rstrip("\ufffd"))
      end -= max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if text[:end].endswith(s[:n])), default=0)
    piece = text[self.sent:max(end, self.sent)]
    self.sent = max(end, self.sent)
    return piece
