"""Special tokens shared by every vocabulary; their ids are fixed so models can rely on them."""

from __future__ import annotations

from typing import Final

PAD: Final = "<pad>"
UNK: Final = "<unk>"
BOS: Final = "<bos>"
EOS: Final = "<eos>"
SEP: Final = "<sep>"

SPECIAL_TOKENS: Final = (PAD, UNK, BOS, EOS, SEP)
# Tokens only models use (padding, start, separator): not words of the corpus, unlike <unk>
# and <eos>, which corpora such as PTB count in their vocabulary.
MODEL_ONLY_TOKENS: Final = frozenset({PAD, BOS, SEP})
PAD_ID: Final = 0
UNK_ID: Final = 1
BOS_ID: Final = 2
EOS_ID: Final = 3
SEP_ID: Final = 4

# Speaker ids in the `speaker` column: 0 is padding, 1 the speaker of the response
# being predicted ("self"), 2 the other party.
SPEAKER_PAD: Final = 0
SPEAKER_SELF: Final = 1
SPEAKER_OTHER: Final = 2
