"""Tools for plugin authors: the contract checks and the new-plugin scaffold."""
