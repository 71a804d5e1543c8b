"""Tools: vendor and case scaffolds, the vendor folder check, and the kernel ceiling.
Imports any stage below it.
"""
