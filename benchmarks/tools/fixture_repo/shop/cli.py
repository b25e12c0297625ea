"""python -m shop.cli "3 x apple @ 1.20" ..."""

import sys

from .orders import order_total, parse_order_line
from .pricing import apply_discount, format_price


def main(argv):
    lines = [parse_order_line(arg) for arg in argv]
    total = order_total(lines)
    print("total:", format_price(total))
    print("with a 10% coupon:", format_price(apply_discount(total)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
