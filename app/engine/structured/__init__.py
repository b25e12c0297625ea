"""Grammar-constrained decoding (structured output) with xgrammar.

`constraint` turns a request's structured-output field into a cache key; `compiler` compiles it
(once per distinct constraint, off the step thread) and hands each sequence its own `matcher`;
`bitmask` masks the constrained rows of a step's logits in one batched op. xgrammar is imported
only when a constrained request arrives: unconstrained runs and `localbatch --help` never load it.
"""
