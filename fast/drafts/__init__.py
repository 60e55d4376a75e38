"""Draft kinds: `scripted` (test drafts that deviate from the target by rule), `lookup_draft`
(prompt lookup), `reduced_head` (a draft scoring a subset of the vocabulary) and `feature_draft` (a
head reading the target's features). The registry from names to factories is
`fast.loading.DRAFT_KINDS`."""
