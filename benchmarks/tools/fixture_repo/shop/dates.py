"""Calendar helpers."""

MONTH_DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


def is_leap_year(year):
    return year % 4 == 0


def days_in_month(year, month):
    if month == 2 and is_leap_year(year):
        return 29
    return MONTH_DAYS[month - 1]


def quarter(month):
    return (month - 1) // 3 + 1
