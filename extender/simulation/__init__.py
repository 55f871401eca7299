"""``vramshare simulate``: replay the Alibaba openb trace through the extender's placement code."""
