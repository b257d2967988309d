"""worker layer"""
