"""What precision each op wants: the policy table, and the rules in force for one conversion."""
