"""The broker's parts, which :class:`gpubroker.core.Broker` (the facade of
commands) builds and calls: the state in memory (:mod:`.world`), the
command runner (:mod:`.runner`), lease commands (:mod:`.leases`),
scheduling (:mod:`.scheduling`, with the coalesced pass loop
:mod:`.passloop`), the inventory (:mod:`.inventory`), server stops
(:mod:`.stops`), admission (:mod:`.admission`), admin operations
(:mod:`.admin`), notices (:mod:`.notices`), the sharing operations
(:mod:`.sharing`, with the :mod:`.actuator` off the event loop), reads
(:mod:`.queries`), what is free (:mod:`.availability`) and the per-lease
long-poll waiters (:mod:`.waiters`)."""
