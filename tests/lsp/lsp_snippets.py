"""Small real two-file projects per language: a library file and a file that imports it.

`<|>` marks the cursor in the main file; the name used at the cursor is defined in the library.
"""

CURSOR = "<|>"

PROJECTS = {
    "python": (
        (
            "file:///proj/pkg/geometry.py",
            "python",
            """\
class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y


def distance(a, b):
    return ((a.x - b.x) ** 2 + (a.y - b.y) ** 2) ** 0.5
""",
        ),
        (
            "file:///proj/pkg/main.py",
            "python",
            """\
from pkg.geometry import Point, distance


def farthest(points):
    origin = Point(0, 0)
    return max(points, key=lambda p: distance(<|>))
""",
        ),
    ),
    "javascript": (
        (
            "file:///proj/src/geometry.js",
            "javascript",
            """\
export class Point {
  constructor(x, y) { this.x = x; this.y = y; }
}

export function distance(a, b) {
  return Math.hypot(a.x - b.x, a.y - b.y);
}
""",
        ),
        (
            "file:///proj/src/main.js",
            "javascript",
            """\
import { Point, distance } from './geometry';

function farthest(points) {
  const origin = new Point(0, 0);
  return points.map((p) => distance(<|>));
}
""",
        ),
    ),
    "typescript": (
        (
            "file:///proj/src/geometry.ts",
            "typescript",
            """\
export interface Point { x: number; y: number }

export function distance(a: Point, b: Point): number {
  return Math.hypot(a.x - b.x, a.y - b.y);
}
""",
        ),
        (
            "file:///proj/src/main.ts",
            "typescript",
            """\
import { distance, Point } from "./geometry";

export function farthest(points: Point[], origin: Point): number {
  return Math.max(...points.map((p) => distance(<|>)));
}
""",
        ),
    ),
    "tsx": (
        (
            "file:///proj/src/geometry.ts",
            "typescript",
            """\
export interface Point { x: number; y: number }

export function distance(a: Point, b: Point): number {
  return Math.hypot(a.x - b.x, a.y - b.y);
}
""",
        ),
        (
            "file:///proj/src/View.tsx",
            "typescriptreact",
            """\
import { distance, Point } from "./geometry";

export function Label(props: { a: Point; b: Point }) {
  return <span>{distance(<|>)}</span>;
}
""",
        ),
    ),
    "go": (
        (
            "file:///proj/mathx/geometry.go",
            "go",
            """\
package mathx

import "math"

type Point struct {
	X, Y float64
}

func Distance(a, b Point) float64 {
	return math.Hypot(a.X-b.X, a.Y-b.Y)
}
""",
        ),
        (
            "file:///proj/cmd/main.go",
            "go",
            """\
package main

import (
	"fmt"

	"example.com/proj/mathx"
)

func main() {
	p := mathx.Point{X: 1, Y: 2}
	fmt.Println(mathx.Distance(<|>))
}
""",
        ),
    ),
    "rust": (
        (
            "file:///proj/src/geometry.rs",
            "rust",
            """\
pub struct Point {
    pub x: f64,
    pub y: f64,
}

pub fn distance(a: &Point, b: &Point) -> f64 {
    ((a.x - b.x).powi(2) + (a.y - b.y).powi(2)).sqrt()
}
""",
        ),
        (
            "file:///proj/src/main.rs",
            "rust",
            """\
mod geometry;
use crate::geometry::{distance, Point};

fn main() {
    let p = Point { x: 1.0, y: 2.0 };
    println!("{}", distance(<|>));
}
""",
        ),
    ),
    "c": (
        (
            "file:///proj/src/geometry.h",
            "c",
            """\
#ifndef GEOMETRY_H
#define GEOMETRY_H
typedef struct { double x, y; } Point;
double distance(Point a, Point b);
#endif
""",
        ),
        (
            "file:///proj/src/main.c",
            "c",
            """\
#include <stdio.h>
#include "geometry.h"

int main(void) {
    Point p = {1.0, 2.0};
    printf("%f\\n", distance(<|>));
    return 0;
}
""",
        ),
    ),
    "cpp": (
        (
            "file:///proj/src/geometry.hpp",
            "cpp",
            """\
#pragma once
namespace geo {
struct Point { double x, y; };
class Shape {
 public:
  virtual double area() const = 0;
};
double distance(const Point& a, const Point& b);
}
""",
        ),
        (
            "file:///proj/src/main.cpp",
            "cpp",
            """\
#include "geometry.hpp"

int main() {
  geo::Point p{1, 2};
  return static_cast<int>(geo::distance(<|>));
}
""",
        ),
    ),
    "java": (
        (
            "file:///proj/src/main/java/com/acme/geo/Point.java",
            "java",
            """\
package com.acme.geo;

public class Point {
    public final double x, y;
    public Point(double x, double y) { this.x = x; this.y = y; }
    public double distance(Point other) {
        return Math.hypot(x - other.x, y - other.y);
    }
}
""",
        ),
        (
            "file:///proj/src/main/java/com/acme/App.java",
            "java",
            """\
package com.acme;

import com.acme.geo.Point;

public class App {
    public static void main(String[] args) {
        Point p = new Point(1, 2);
        System.out.println(p.distance(<|>));
    }
}
""",
        ),
    ),
}


def split_cursor(text: str) -> tuple[str, int]:
    """Text without the marker, and the marker's code point offset."""
    at = text.index(CURSOR)
    return text[:at] + text[at + len(CURSOR) :], at
