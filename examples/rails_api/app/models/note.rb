# frozen_string_literal: true

# A note: a title (required, at most 200 characters) and a body.
class Note < ApplicationRecord
  validates :title, presence: true, length: { maximum: 200 }
end
