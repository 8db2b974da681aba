"""Sub-floor L2.3, the group's lifecycle: joining it, knowing its members, leaving it.

``join.py`` (the rendezvous, done while the listener parks what it accepts, and the
frozen ``Group`` it returns), ``rendezvous.py`` (the store: claim a rank, publish an
address, barriers), ``membership.py`` (who is in the group; a dynamic group's newcomers
looked up in the store) and ``shutdown.py`` (the graceful-shutdown rounds). May import
``net/``, ``shm/``, the runtime's base modules and the floors below; never ``calls/`` or
the agent.
"""
