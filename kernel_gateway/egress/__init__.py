"""What leaves a sandbox for the network, through the gateway and on its terms.

:mod:`.forwarder` is the HTTP forwarding core: a listener a sandbox reaches
through a Unix socket bound into it, forwarding only what one client's routes
allow and adding the operator's credential on the way out, so that no secret
ever enters the sandbox.  Codex jobs reach their model through it.
"""
