"""Hidden states -> GRPO loss in one call: LM-head statistics, loss head, LM-head gradients."""
