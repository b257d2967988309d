"""observability layer"""
