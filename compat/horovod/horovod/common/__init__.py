"""``horovod.common``: the framework-independent names Horovod scripts import (errors, process sets, elastic state)."""
