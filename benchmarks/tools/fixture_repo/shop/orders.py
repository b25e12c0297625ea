"""Orders: parsing order lines and totalling them."""

from .inventory import Inventory, OutOfStock
from .pricing import apply_discount, shipping_cost, subtotal, with_tax


def parse_quantity(text):
    value = int(text)
    if value <= 0:
        raise ValueError(f"quantity must be positive: {text}")
    return value


def parse_order_line(line):
    """'3 x apple @ 1.20' -> ('apple', 3, 1.2)"""
    count, rest = line.split(" x ", 1)
    name, price = rest.split(" @ ")
    return name.strip(), parse_quantity(count), float(price)


def order_total(lines, discount=0):
    tmp = subtotal([(price, n) for _, n, price in lines])
    if discount:
        tmp = apply_discount(tmp, discount)
    tmp = with_tax(tmp)
    return tmp + shipping_cost(tmp)


def reserve(inventory: Inventory, lines):
    for name, n, _ in lines:
        if inventory.count(name) < n:
            raise OutOfStock(name)
    for name, n, _ in lines:
        inventory.remove(name, n)


def member_total(lines):
    return apply_discount(order_total(lines), 5)
