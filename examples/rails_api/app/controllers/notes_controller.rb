# frozen_string_literal: true

# GET /notes (the newest first, at most `limit`, default 50, up to 500),
# GET /notes/:id, POST /notes with JSON `{"title": ..., "body": ...}`
# (or `{"note": {...}}`): 201 with the note, or 422 with the errors.
class NotesController < ApplicationController
  def index
    limit = params.fetch(:limit, 50).to_i.clamp(1, 500)
    render json: Note.order(id: :desc).limit(limit)
  end

  def show
    render json: Note.find(params[:id])
  end

  def create
    note = Note.new(params.require(:note).permit(:title, :body))
    if note.save
      render json: note, status: :created, location: note
    else
      render json: { errors: note.errors }, status: :unprocessable_entity
    end
  end
end
