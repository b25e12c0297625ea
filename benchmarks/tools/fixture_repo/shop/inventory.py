"""Stock kept per item name."""

MAX_STOCK = 500


class OutOfStock(Exception):
    pass


class Inventory:
    def __init__(self):
        self.stock = {}

    def add(self, item, quantity):
        new = self.stock.get(item, 0) + quantity
        if new > MAX_STOCK:
            raise ValueError(f"at most {MAX_STOCK} of {item}")
        self.stock[item] = new

    def remove(self, item, quantity):
        # TODO: refuse to go below zero
        self.stock[item] = self.stock.get(item, 0) - quantity

    def count(self, item):
        return self.stock.get(item, 0)

    def low_stock(self, threshold=5):
        return sorted(name for name, n in self.stock.items() if n < threshold)
