"""Prices: subtotals, discounts, tax and shipping."""

TAX_RATE = 0.2
FREE_SHIPPING_OVER = 50
SHIPPING_FEE = 4.99
DEFAULT_CURRENCY = "EUR"


def subtotal(items):
    """The sum of price times quantity over (price, quantity) pairs."""
    return sum(price * quantity for price, quantity in items)


def apply_discount(total, percent=10):
    """`total` with `percent` percent taken off."""
    return total * percent / 100


def shipping_cost(total):
    """Shipping is free above FREE_SHIPPING_OVER."""
    if total > FREE_SHIPPING_OVER:
        return 0
    return SHIPPING_FEE


def with_tax(total):
    return round(total * (1 + TAX_RATE), 2)


def format_price(amount, currency=DEFAULT_CURRENCY):
    return f"{amount:.2f} {currency}"
