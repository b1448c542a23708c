"""The node agent: one per node, it launches the ranks placed there and publishes the node's facts."""
