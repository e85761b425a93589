"""TRANSITIONAL stub of the LoRA forward context (replaced by the slot-based LoRA layers)."""


class RowMapping:
    @classmethod
    def of(cls, compositions):
        return cls()


def lora_context_of(module):
    return None
