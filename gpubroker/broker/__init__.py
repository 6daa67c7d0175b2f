"""The broker's parts: in-memory state (:mod:`.world`), the coalesced pass
loop (:mod:`.passloop`) and the per-lease waiters (:mod:`.waiters`). The
facade of commands is :class:`gpubroker.core.Broker`."""
