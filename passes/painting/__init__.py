"""IR-neutral painting: allow/infer/deny/clear classes on a networkx view of any graph."""
